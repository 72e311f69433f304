"""``verifiers`` environments (prime-rl's, PyPI ``verifiers`` v1) run against the rollout's own vLLM engine, as
token-exact multi-turn trajectories.

A ``verifiers`` environment drives the model itself: its harness program (the built-in ``null`` chat loop, or any
other) talks to verifiers' interception server, whose train client renders each request to token ids with the
``renderers`` package and posts them to a vLLM ``/inference/v1/generate`` endpoint. gyre serves that endpoint from
the rollout's ``RolloutEngine`` (``rollout.agents.generate_endpoint``), one URL per episode, and records every call. The
trajectory is built from those records only, never from the environment's transcript:

- call 0's prompt ids are the trajectory's prompt; each call's sampled ids are a model turn (mask 1, the engine's
  behaviour logprobs and policy-version spans);
- every later call's prompt must *extend* the context so far (prompt + everything appended); the extension is the
  observation (tool results, the next user turn, the template's turn markers: mask 0). A call whose prompt does not
  extend it means the program re-rendered its transcript, so the tokens the learner would train on are not the ones
  that were sampled: the episode is broken (``reward_error "episode-verifiers_retokenized: ..."``), never trained on.

The episode's reward is its verifiers trace's (the task's ``@vf.reward`` functions, weighted). A verifiers failure
(harness error, timeout, a refused request) breaks the episode with the reason; the worker goes on. Episodes of one
group all play the same verifiers task, ``tasks[prompt_index % (len(tasks) - heldout)]`` in the taskset's order; the
last ``heldout`` tasks are only played by held-out evaluation.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from gyre.rollout.agents.agent_group import EnvironmentLoadError, episode_rows, share_prompt
from gyre.rollout.config import SamplingConfig
from gyre.rollout.agents.environment import VerifiersConfig
from gyre.rollout.agents.episode import Episode
from gyre.rollout.agents.generate_endpoint import Call, GenerateEndpoint

log = structlog.get_logger("gyre.rollout.verifiers")

LOCAL_AGENT = {"harness": {"id": "null", "env": {"PYTHONFAULTHANDLER": "1"}}, "runtime": {"type": "subprocess"}}
"""What a role of the verifiers env config gets when the recipe leaves it unset: verifiers' own tool-capable chat
loop (``null`` harness), run as a local subprocess (verifiers' own default runtime is a Prime sandbox), with
Python's faulthandler on: a program that dies of a signal (an ``abort()`` in C or Rust code, ``exited -6``) writes
every thread's Python stack to stderr first, whose tail verifiers puts in the episode's error; without it such an
abort leaves no output at all."""


@dataclass(frozen=True)
class VerifiersProblem:
    """A held-out verifiers task as an evaluation problem (``rollout.evaluation.select_sets``' shape)."""

    task: str
    """The set name: the taskset id."""
    question: str
    """The task's prompt text (for the records)."""
    entry: dict
    index: int
    """Index of the task in the taskset."""


class VerifiersLoadError(EnvironmentLoadError):
    """The verifiers package, taskset or env config does not load; the message names which and why."""


def env_config(config: VerifiersConfig):
    """The validated verifiers ``EnvConfig`` of ``config``: ``config.env`` with ``taskset.id`` set and every unset
    role given ``LOCAL_AGENT``.

    Raises:
        VerifiersLoadError: verifiers is not installed, the taskset does not import, or the config is invalid.
    """
    try:
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.utils.loaders import resolve_env_config
    except ImportError as exc:
        raise VerifiersLoadError(f"rollout.verifiers needs the verifiers package ({exc}): pip install "
                                 "'gyre[verifiers]' (make setup installs it)") from exc
    ident = config.taskset_id
    if config.taskset.endswith(".py") and str(Path(config.taskset).parent) not in sys.path:
        sys.path.insert(0, str(Path(config.taskset).parent))
    raw = copy.deepcopy(config.env)
    taskset = raw.setdefault("taskset", {})
    if not isinstance(taskset, dict) or taskset.get("id", ident) != ident:
        raise VerifiersLoadError(f"rollout.verifiers.env.taskset is {taskset!r:.120}; expected a mapping whose "
                                 f"id (if any) is rollout.verifiers.taskset's ({ident!r})")
    taskset["id"] = ident
    try:
        roles = agent_config_fields(resolve_env_config(raw))
        for name in roles:
            role = raw.setdefault(name, {})
            for key, value in LOCAL_AGENT.items():
                role.setdefault(key, copy.deepcopy(value))
        return resolve_env_config(raw)
    except Exception as exc:  # noqa: BLE001 - import errors, pydantic errors, the taskset's own code
        raise VerifiersLoadError(f"rollout.verifiers (taskset {ident!r}): {type(exc).__name__}: "
                                 f"{exc}"[:3000]) from exc


def renderer_config(config: VerifiersConfig):
    """The ``renderers`` config of ``config.renderer`` (``None``: ``TemplateBridgeRenderer``).

    Raises:
        VerifiersLoadError: the config does not validate (unknown name, bad fields)."""
    from pydantic import TypeAdapter
    from renderers import RendererConfig

    from gyre.rollout.agents.verifiers_renderer import IMPORT_PATH

    raw = config.renderer if config.renderer is not None else {"name": "custom", "import_path": IMPORT_PATH}
    try:
        return TypeAdapter(RendererConfig).validate_python(raw)
    except Exception as exc:  # noqa: BLE001 - pydantic errors, a custom renderer's import
        raise VerifiersLoadError(f"rollout.verifiers.renderer {raw!r:.200}: {type(exc).__name__}: {exc}"[:3000]
                                 ) from exc


def assemble(calls: list[Call], version: int) -> Episode:
    """The trajectory of one episode's generate calls (in answer order): call 0's prompt, then each call's sampled
    turn (mask 1) after the extension of its prompt past the context so far (mask 0).

    Returns the episode; ``error`` is set (``"episode-verifiers_retokenized: ..."``) at the first call whose prompt
    does not extend the context, with the turns before it kept for inspection, and (``"episode-verifiers_error:
    ..."``) when there was no call. ``version``: the span of an episode with no turn."""
    if not calls:
        episode = Episode(prompt_token_ids=[], error="episode-verifiers_error: the environment made no model call")
        episode.close_empty(version)
        return episode
    episode = Episode(prompt_token_ids=list(calls[0].prompt_token_ids))
    for k, call in enumerate(calls):
        context = episode.context
        if k:
            head = call.prompt_token_ids[:len(context)]
            if head != context:
                at = next((i for i, (a, b) in enumerate(zip(head, context)) if a != b), len(head))
                episode.error = (f"episode-verifiers_retokenized: call {k}'s prompt ({len(call.prompt_token_ids)} "
                                 f"tokens) does not extend the episode's context ({len(context)} tokens), first "
                                 f"difference at token {at}: the program re-rendered its transcript, so the earlier "
                                 "turns' tokens are not the sampled ones")
                break
            episode.add_observation(call.prompt_token_ids[len(context):], [])
        episode.add_turn(call.sample)
        episode.finish_reason = call.sample.finish_reason
    episode.close_empty(version)
    return episode


def score(episode: Episode, vf_episode, refused: list[str]) -> Episode:
    """Fill ``episode``'s reward, end, tool count and transcript from the verifiers episode; break it (``error``)
    when verifiers reports a failure, a request was refused, or it holds other than one trace."""
    traces = list(vf_episode.traces)
    why = ""
    if refused:
        why = f"episode-verifiers_error: gyre refused a generate request: {refused[0]}"[:2000]
    elif len(traces) != 1:
        why = (f"episode-verifiers_error: the episode holds {len(traces)} traces; gyre trains single-agent episodes "
               "(one trace)")
    elif not vf_episode.ok:
        last = vf_episode.last_error or (traces[0].errors[-1] if traces[0].errors else None)
        why = f"{last.type}: {last.message}" if last is not None else f"stopped by {traces[0].stop_condition}"
        why = f"episode-verifiers_error: {why}"[:2000]
    if why and not episode.error.startswith("episode-verifiers_retokenized"):
        episode.error = why  # verifiers' own reason beats "no model call"
    if traces:
        trace = traces[0]
        episode.reward = float(trace.reward)
        episode.tool_calls = sum(len(m.tool_calls or []) for m in trace.assistant_messages)
        episode.messages = [{"role": str(m.role), "content": m.content if isinstance(m.content, str)
                             else str(m.content)} for m in trace.messages]
        episode.episode_end = episode_end(trace)
        if episode.episode_end != "done":
            episode.finish_reason = "length"
    return episode


TOKEN_LIMITS = ("max_input_tokens", "max_output_tokens", "max_total_tokens")


def episode_end(trace) -> str:
    """``proto.trajectory.EPISODE_ENDS`` of a verifiers trace: ``"max_turns"`` (its ``max_turns`` stop),
    ``"max_tokens"`` (a token-limit stop, or a model call refused for the context length: verifiers ends such an
    episode as truncated), else ``"done"``."""
    stop = trace.stop_condition or ""
    if stop == "max_turns":
        return "max_turns"
    if stop in TOKEN_LIMITS or any(c.error is not None and "context length" in c.error.message for c in trace.calls):
        return "max_tokens"
    return "done"


def _uv_on_path() -> None:
    """verifiers prepares its harness programs with ``uv``; make this environment's ``uv`` (gyre's dev extra, or
    any on PATH) the one it finds, instead of a ``pip install --user uv``."""
    here = Path(sys.executable).parent
    if shutil.which("uv") is None and (here / "uv").is_file():
        os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"


class VerifiersRunner:
    """Runs a rollout's groups as verifiers episodes (``run_group``/``rows``: ``rollout.agents.agent_group.EpisodeRunner``'s
    interface, which the worker uses).

    Args:
        config: the recipe's ``rollout.verifiers``.
        model: the policy's local HF folder (the renderer's tokenizer and chat template).
        tokenizer: the policy's tokenizer (its vocabulary bounds request token ids).

    Raises:
        VerifiersLoadError: see ``env_config``; or the env or its taskset raises while loading, or the taskset has
            no more tasks than ``heldout``.
    """

    task_reward = False
    """The verifiers task scores its episodes; the gyre task's reward functions do not."""

    def __init__(self, config: VerifiersConfig, model: str, tokenizer) -> None:
        resolved = env_config(config)  # first: it names a missing verifiers package
        from verifiers.v1.utils.loaders import load_environment

        import verifiers

        self.config, self.model, self.vocab_size = config, model, len(tokenizer)
        try:
            self.env = load_environment(resolved)
        except Exception as exc:  # noqa: BLE001 - the env class's own constructor
            raise VerifiersLoadError(f"rollout.verifiers (taskset {config.taskset_id!r}): building the env raised "
                                     f"{type(exc).__name__}: {exc}"[:3000]) from exc
        try:
            self.tasks = list(self.env.taskset)
        except Exception as exc:  # noqa: BLE001 - the taskset's own loading code
            raise VerifiersLoadError(f"rollout.verifiers taskset {config.taskset!r}: load() raised "
                                     f"{type(exc).__name__}: {exc}"[:3000]) from exc
        if len(self.tasks) <= config.heldout:
            raise VerifiersLoadError(f"rollout.verifiers taskset {config.taskset!r} has {len(self.tasks)} tasks; "
                                     f"expected more than rollout.verifiers.heldout ({config.heldout}), so that some "
                                     "are left to train on")
        self.train_count = len(self.tasks) - config.heldout
        """Tasks ``[0, train_count)`` are trained on, the rest held out."""
        self.renderer = renderer_config(config)
        self.version = f"verifiers:{config.taskset_id}@{getattr(verifiers, '__version__', '?')}"
        """Recorded as each row's ``reward_fn_version``."""
        self.endpoint: GenerateEndpoint | None = None
        self._serving: contextlib.AsyncExitStack | None = None
        self._start_lock = asyncio.Lock()
        self._slots: asyncio.Semaphore | None = None

    def client_config(self, base_url: str):
        """verifiers' ``TrainClientConfig`` for an episode served at ``base_url`` (renderer: see ``renderer``)."""
        from verifiers.v1.configs.client import TrainClientConfig

        return TrainClientConfig(base_url=base_url, renderer_model_name=self.model, renderer=self.renderer)

    async def _start(self) -> GenerateEndpoint:
        async with self._start_lock:
            if self.endpoint is None:
                _uv_on_path()
                endpoint = GenerateEndpoint(self.vocab_size, model_name=self.model)
                await endpoint.start()
                stack = contextlib.AsyncExitStack()
                stack.push_async_callback(endpoint.close)
                await stack.enter_async_context(self.env.serving())
                self.endpoint, self._serving = endpoint, stack
                self._slots = asyncio.Semaphore(self.config.max_concurrent)
            return self.endpoint

    async def close(self) -> None:
        """Stop verifiers' serving resources and the endpoint."""
        if self._serving is not None:
            await self._serving.aclose()
            self._serving = self.endpoint = self._slots = None

    def heldout(self, task=None) -> list[VerifiersProblem]:
        """The held-out tasks as evaluation problems (``rollout.agents.episode_eval``; ``task``, the gyre task, unused)."""
        return [VerifiersProblem(self.config.taskset_id, t.data.prompt_text, {}, i)
                for i, t in enumerate(self.tasks) if i >= self.train_count]

    def fallback_prompt(self, problem, prompt_ids) -> list[int]:
        """The prompt of an evaluation group none of whose episodes started: none (its records carry the error)."""
        return []

    async def run_group(self, engine, problem: Any, n: int, sampling: SamplingConfig, request_id: str,
                        max_model_len: int, seed: int | None, fallback_prompt: list[int],
                        prompt_index: int = 0) -> list[Episode]:
        """``n`` episodes of one verifiers task: ``problem``'s when it is a ``VerifiersProblem`` (evaluation), else
        training task ``prompt_index % train_count`` (the gyre ``problem`` is not used: the taskset holds the
        problems). Episode ``i``'s call ``k`` samples with seed ``seed + 1000 i + k``. Raises what the engine
        raised (``EngineFailedError``)."""
        from verifiers.v1.clients import ModelContext

        endpoint = await self._start()
        task = (self.tasks[problem.index] if isinstance(problem, VerifiersProblem)
                else self.tasks[prompt_index % self.train_count])

        async def one(i: int) -> Episode:
            async with self._slots:
                return await play(i)

        async def play(i: int) -> Episode:
            key, url = endpoint.open(engine, sampling, max_model_len, None if seed is None else seed + 1000 * i)
            ctx = ModelContext(model=self.model, client=self.client_config(url))
            vf_episode, broke = None, ""
            try:
                vf_episode = await asyncio.wait_for(self.env.run_episode(task, ctx), self.config.time_budget_s)
            except TimeoutError:
                broke = f"episode-time_budget: over {self.config.time_budget_s:g} s"
            except Exception as exc:  # noqa: BLE001 - verifiers and the environment's own code
                broke = f"episode-verifiers_error: run_episode raised {type(exc).__name__}: {exc}"[:2000]
            finally:
                calls, refused = endpoint.close_episode(key)
            episode = assemble(calls, engine.version)
            if vf_episode is not None:
                episode = score(episode, vf_episode, refused)
            episode.error = broke or episode.error
            if episode.error:
                log.info("verifiers_episode_broken", request_id=f"{request_id}-e{i}", error=episode.error[:300])
            return episode

        episodes = list(await asyncio.gather(*(one(i) for i in range(n))))
        return share_prompt(episodes, fallback_prompt, engine.version,
                            "the verifiers task rendered another first prompt than the group's other episodes")

    def rows(self, episodes: list[Episode], prompt_index: int, attempt: int, task: str, rollout_id: str,
             timeline: int, task_scores=None):
        """Trajectory rows of a group's episodes (``rollout.agents.agent_group.episode_rows``)."""
        return episode_rows(episodes, self.version, prompt_index, attempt, task, rollout_id, timeline, task_scores)
