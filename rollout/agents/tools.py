"""Tools for multi-turn episodes: a calculator, Python in the sandbox, and the tool-call format.

**Format.** gyre uses the Hermes/Qwen function-calling format, the one most open chat templates render (Qwen2.5,
Hermes, and vLLM's ``hermes`` tool parser): the system message lists the tools as JSON schemas inside
``<tools></tools>``, the model calls one with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in its
turn, and each result comes back as a ``tool``-role message, rendered by the policy's own chat template. A
template without tool support (SmolLM2's) renders the ``tool`` role like any other role; the system prompt
carries the tool list either way, so the same episode works on both.

**Tools** are plain blocking functions of JSON arguments returning text (``Tool``); ``ToolEnvironment`` runs them
inside ``step`` (a worker thread). Each bounds itself: the calculator refuses huge powers and results, the Python
tool runs in ``rollout.rewards.sandbox`` (separate process, rlimits, wall-clock kill, no network) and returns at
most ``max_output_chars`` of stdout. A tool that raises, times out or is called with bad arguments gives the
model an ``error: ...`` result and counts as a tool error; the episode goes on.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable

from gyre.rollout.agents.environment import Environment, EnvStep, Message
from gyre.rollout.rewards.sandbox import SandboxConfig, run_python


class ToolError(ValueError):
    """A tool refused its input; the message is shown to the model as the result."""


@dataclass(frozen=True)
class Tool:
    """One callable tool: ``fn(**arguments) -> str`` (blocking), described to the model by ``schema``."""

    name: str
    description: str
    parameters: dict
    """JSON schema of the arguments object (``{"type": "object", "properties": ..., "required": [...]}``)."""
    fn: Callable[..., str]

    def schema(self) -> dict:
        """The OpenAI/Hermes function description: ``{"type": "function", "function": {...}}``."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_MAGNITUDE = 1e100
"""Largest absolute value the calculator computes (intermediate results included)."""


def calculate(expression: str) -> str:
    """Evaluate an arithmetic ``expression`` (numbers, ``+ - * / // % **``, parentheses); an integral result is
    printed without a decimal point. Raises ``ToolError`` for anything else, division by zero, an exponent
    above 1000 in magnitude, or a value past ``MAX_MAGNITUDE``."""
    if not isinstance(expression, str) or len(expression) > 1000:
        raise ToolError("expression must be a string of at most 1000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"cannot parse {expression!r}: {exc.msg}") from None

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            value = node.value
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            value = _UNARY[type(node.op)](ev(node.operand))
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 1000:
                raise ToolError(f"exponent {right} is too large (at most 1000)")
            try:
                value = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("result too large") from None
        else:
            raise ToolError(f"only numbers and + - * / // % ** are allowed, not {ast.unparse(node)!r}")
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE or (isinstance(value, float) and math.isnan(value)):
            raise ToolError("result too large or not a real number")
        return value

    value = ev(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def calculator() -> Tool:
    """The ``calculator`` tool (``calculate``)."""
    return Tool("calculator", "Evaluate an arithmetic expression exactly, e.g. '(12 + 7) * 3 - 5'.",
                {"type": "object", "properties": {"expression": {"type": "string",
                                                                 "description": "the arithmetic expression"}},
                 "required": ["expression"]}, calculate)


def python_tool(config: SandboxConfig | None = None, max_output_chars: int = 2000) -> Tool:
    """The ``python`` tool: runs code in ``rollout.rewards.sandbox`` (defaults: 5 s wall, 1 GiB, no network) and
    returns its stdout (at most ``max_output_chars``), or ``ToolError`` with the failure (exception, timeout,
    memory, forbidden operation)."""
    config = (config or SandboxConfig(timeout_s=5.0)).model_copy(update={"stdout_head_chars": max_output_chars})

    def run(code: str) -> str:
        if not isinstance(code, str):
            raise ToolError("code must be a string")
        result = run_python(code, config)
        if not result.passed:
            raise ToolError(f"{result.status}: {result.detail}"[:max_output_chars])
        return result.stdout + ("\n[output cut]" if result.stdout_cut else "")

    return Tool("python", "Run a Python program and return what it prints (no network, 5 s).",
                {"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                 "required": ["code"]}, run)


TOOLS: dict[str, Callable[[], Tool]] = {"calculator": calculator, "python": python_tool}
"""Built-in tools by name (``ToolEnvironment(tools=[...])``)."""

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse_tool_calls(text: str) -> list[dict | str]:
    """Each ``<tool_call>`` block of a model turn, in order: ``{"name": str, "arguments": dict}``, or a string
    saying why the block is not a call (not JSON, no name, arguments not an object). A block cut off at the end
    of the turn (no closing tag) is parsed too."""
    calls: list[dict | str] = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(f"tool call is not JSON ({exc.msg}): {body[:200]!r}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(f"tool call needs a string 'name': {body[:200]!r}")
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(f"tool call 'arguments' must be an object: {body[:200]!r}")
            continue
        calls.append({"name": call["name"], "arguments": args})
    return calls


def tools_system_prompt(tools: list[Tool], instructions: str = "") -> str:
    """The Hermes function-calling system prompt listing ``tools``, then ``instructions``."""
    listed = "\n".join(json.dumps(t.schema()) for t in tools)
    return (f"{instructions}\n\n" if instructions else "") + (
        "You may call tools. Their signatures are inside <tools></tools>:\n<tools>\n" + listed + "\n</tools>\n"
        "To call one, write <tool_call>{\"name\": <tool name>, \"arguments\": <arguments object>}</tool_call>; "
        "its result comes back in the next message. When you know the answer, reply without a tool call.")


def run_tool(tools: dict[str, Tool], call: dict | str, max_output_chars: int) -> tuple[str, bool]:
    """``(result text, failed)`` of one parsed call; never raises (errors become ``"error: ..."``)."""
    if isinstance(call, str):
        return f"error: {call}", True
    tool = tools.get(call["name"])
    if tool is None:
        return f"error: unknown tool {call['name']!r}; available: {sorted(tools)}", True
    try:
        out = tool.fn(**call["arguments"])
    except ToolError as exc:
        return f"error: {exc}"[:max_output_chars], True
    except TypeError as exc:  # wrong or missing arguments
        return f"error: bad arguments for {tool.name}: {exc}"[:max_output_chars], True
    except Exception as exc:  # noqa: BLE001 - a tool's own bug is the episode's tool error, not the worker's
        return f"error: {tool.name} failed: {type(exc).__name__}: {exc}"[:max_output_chars], True
    out = str(out)
    return (out[:max_output_chars] + "\n[output cut]") if len(out) > max_output_chars else out, False


class ToolEnvironment(Environment):
    """A question answered with tools: the system prompt lists the tools, each model turn's tool calls are run
    and their results returned as ``tool`` messages; a turn without a tool call is the final answer (``done``).
    The answer is scored by the task's reward functions (``EnvironmentConfig.task_reward``); this environment
    gives no reward of its own.

    Args:
        tools: names from ``TOOLS``.
        instructions: text before the tool list in the system prompt.
        max_calls_per_turn: calls run per turn; further calls in the same turn get an error result.
        max_output_chars: longest tool result shown to the model.
        few_shot: messages placed between the system prompt and the question (a worked example of a tool call:
            ``user``, ``assistant`` with a ``<tool_call>``, ``tool``, ``assistant``), for a model never trained on
            the format.
    """

    def __init__(self, tools: list[str] | tuple[str, ...] = ("calculator",), instructions: str = "",
                 max_calls_per_turn: int = 4, max_output_chars: int = 2000,
                 few_shot: list[Message] | tuple = ()) -> None:
        unknown = sorted(set(tools) - set(TOOLS))
        if unknown or not tools:
            raise ValueError(f"tools {list(tools)}: unknown {unknown}; expected a non-empty list of {sorted(TOOLS)}")
        bad = [m for m in few_shot if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and isinstance(m.get("content"), str))]
        if bad:
            raise ValueError(f"few_shot {bad[:1]!r:.200}: expected messages {{'role': str, 'content': str}}")
        self.tools = {name: TOOLS[name]() for name in tools}
        self.instructions, self.max_calls, self.max_output = instructions, max_calls_per_turn, max_output_chars
        self.few_shot = [dict(m) for m in few_shot]

    def reset(self, problem: Any) -> list[Message]:
        question = getattr(problem, "question", problem)
        return [{"role": "system", "content": tools_system_prompt(list(self.tools.values()), self.instructions)},
                *self.few_shot, {"role": "user", "content": str(question)}]

    def step(self, completion: str) -> EnvStep:
        calls = parse_tool_calls(completion)
        if not calls:
            return EnvStep(done=True)
        results, errors = [], 0
        for i, call in enumerate(calls):
            if i >= self.max_calls:
                text, failed = f"error: at most {self.max_calls} tool calls per turn", True
            else:
                text, failed = run_tool(self.tools, call, self.max_output)
            errors += failed
            results.append({"role": "tool", "content": text})
        return EnvStep(observation=results, tool_calls=len(calls), tool_errors=errors)
