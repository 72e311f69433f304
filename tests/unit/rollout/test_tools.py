"""The tool kit of multi-turn episodes: calculator, sandboxed Python, the Hermes tool-call format, and what a
misbehaving tool or model turns into (an error result the model reads, never an exception)."""

from __future__ import annotations

import pytest

from gyre.rollout.agents.environment import EnvStep
from gyre.rollout.agents.tools import (ToolEnvironment, ToolError, calculate, calculator, parse_tool_calls, python_tool,
                           run_tool, tools_system_prompt)


@pytest.mark.parametrize("expression, value", [("(12 + 7) * 3 - 5", "52"), ("7 / 2", "3.5"), ("-2 ** 3", "-8"),
                                               ("17 // 5 + 17 % 5", "5"), (" 4.0 * 2 ", "8")])
def test_calculator_computes_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('ls')", "only numbers and"), ("1 / 0", "division by zero"),
    ("2 ** 100000", "exponent 100000 is too large"), ("10 ** 99 * 10 ** 99", "too large"),
    ("(-1) ** 0.5", "not a real number"), ("1 +", "cannot parse"), ("x" * 1001, "at most 1000 characters"),
])
def test_calculator_refuses_everything_else_saying_why(expression, message):
    with pytest.raises(ToolError, match=message):
        calculate(expression)


def test_tool_calls_are_parsed_in_the_hermes_format():
    text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>\n'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            '<tool_call>not json</tool_call><tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}')  # cut at the turn's end
    calls = parse_tool_calls(text)
    assert calls[0] == {"name": "calculator", "arguments": {"expression": "2+2"}}
    assert calls[1] == {"name": "python", "arguments": {"code": "print(1)"}}
    assert calls[2].startswith("tool call is not JSON") and "needs a string 'name'" in calls[3]
    assert "'arguments' must be an object" in calls[4]
    assert calls[5] == {"name": "calculator", "arguments": {"expression": "1"}}
    assert parse_tool_calls("The answer is 4.") == []


def test_bad_calls_become_error_results_the_model_reads():
    tools = {"calculator": calculator()}
    assert run_tool(tools, {"name": "calculator", "arguments": {"expression": "6*7"}}, 100) == ("42", False)
    assert run_tool(tools, {"name": "search", "arguments": {}}, 100) == (
        "error: unknown tool 'search'; available: ['calculator']", True)
    text, failed = run_tool(tools, {"name": "calculator", "arguments": {"expr": "1"}}, 100)
    assert failed and text.startswith("error: bad arguments for calculator")
    assert run_tool(tools, "tool call is not JSON", 100) == ("error: tool call is not JSON", True)


def test_python_runs_sandboxed_and_its_failures_and_floods_are_bounded():
    py = {"python": python_tool(max_output_chars=50)}
    assert run_tool(py, {"name": "python", "arguments": {"code": "print(sum(range(10)))"}}, 50) == ("45\n", False)
    flood, failed = run_tool(py, {"name": "python", "arguments": {"code": "print('x' * 10_000_000)"}}, 50)
    assert not failed and flood == "x" * 50 + "\n[output cut]"
    crash, failed = run_tool(py, {"name": "python", "arguments": {"code": "raise KeyError('k')"}}, 200)
    assert failed and crash.startswith("error: failed: KeyError")
    net, failed = run_tool(py, {"name": "python", "arguments": {
        "code": "import socket\nsocket.create_connection(('192.0.2.1', 80), timeout=1)"}}, 200)
    assert failed and net.startswith("error:")


def test_a_hanging_python_tool_is_killed_at_its_wall_clock():
    from gyre.rollout.rewards.sandbox import SandboxConfig

    py = {"python": python_tool(SandboxConfig(timeout_s=1.0))}
    text, failed = run_tool(py, {"name": "python", "arguments": {"code": "while True: pass"}}, 200)
    assert failed and text.startswith("error: timeout")


def test_the_tool_environment_runs_calls_and_ends_on_an_answer():
    env = ToolEnvironment(tools=["calculator"], instructions="Answer with a number.", max_calls_per_turn=2)
    first = env.reset(type("P", (), {"question": "What is 6*7?"})())
    assert first[0]["role"] == "system" and '"name": "calculator"' in first[0]["content"]
    assert first[0]["content"].startswith("Answer with a number.") and first[1] == {"role": "user",
                                                                                    "content": "What is 6*7?"}
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    step = env.step(call + call + call)
    assert step == EnvStep(observation=[{"role": "tool", "content": "42"}] * 2 + [
        {"role": "tool", "content": "error: at most 2 tool calls per turn"}], tool_calls=3, tool_errors=1)
    assert env.step("The answer is 42.") == EnvStep(done=True)
    with pytest.raises(ValueError, match=r"unknown \['web'\]"):
        ToolEnvironment(tools=["web"])
    assert "<tools>" in tools_system_prompt([calculator()])
