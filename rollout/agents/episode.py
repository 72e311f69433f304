"""Running one multi-turn episode token-in/token-out, with exact behaviour logprobs and version spans.

The context the engine samples from only ever grows by appending: the prompt (the chat template applied to the
environment's first messages), then per turn exactly the tokens the engine returned, then the observation's
tokens. Nothing is re-rendered or re-tokenised between turns, so the trajectory the learner trains on
(``prompt_token_ids + response_token_ids``) is token for token the context each turn was sampled from — the
property re-tokenising a chat transcript breaks (verl's agent loop and slime keep token ids for the same
reason).

Observation tokens come from the chat template by difference (``TurnRenderer``): the template renders a fixed
probe conversation, and again with the observation messages and the next assistant header appended; the
appended text is what follows the model's turn. Before it comes what the template writes after an assistant
turn's end token (SmolLM2's ``"\\n"``), and the end token itself when the model's turn did not end with it
(cut at ``max_new_tokens``). All of it has loss mask 0.

Version spans: each turn's ``Sample`` carries spans relative to that turn; they are shifted by the turn's
offset and a span continuing the previous version is merged, so the episode's spans satisfy the trajectory
invariants (starts strictly increasing, versions non-decreasing) and a weight update between or inside turns
shows exactly where it took effect.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from gyre.rollout.config import SamplingConfig
from gyre.rollout.agents.env_threads import EnvCallsStuckError, EnvThreads
from gyre.rollout.agents.environment import Environment, EnvStep, EpisodeConfig, Message
from gyre.rollout.types import Sample

log = structlog.get_logger("rollout.episode")

_PROBE: list[Message] = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]


class TurnRenderer:
    """Token ids of prompts and observations from the policy's chat template (HF tokenizer).

    Raises ``ValueError`` at construction when the template cannot be diffed: it does not render the probe
    conversation as a prefix of the probe plus more messages, or the assistant turn does not end with the
    tokenizer's ``eos_token``.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.end_text = tokenizer.eos_token
        self.end_id = tokenizer.convert_tokens_to_ids(self.end_text)
        probe = self._render(_PROBE, add_generation_prompt=False)
        end = probe.rfind(self.end_text)
        if end < 0 or not probe[:end].endswith(_PROBE[-1]["content"]):
            raise ValueError(f"the chat template does not end an assistant turn with eos_token {self.end_text!r} "
                             f"right after its content: {probe!r}")
        self.after_end = probe[end + len(self.end_text):]
        """Template text after an assistant turn's end token (SmolLM2: ``"\\n"``)."""
        self._probe = probe

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """``[P]`` ids of ``messages`` with the assistant generation header (the episode's prompt)."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def observation_ids(self, observation: list[Message], turn_closed: bool) -> list[int]:
        """``[O]`` ids to append after a model turn: (the end token when ``turn_closed`` is False) + the template's
        text after it + ``observation`` rendered + the next assistant header.

        Raises ``ValueError`` when the template renders the probe differently once messages follow it."""
        return list(self.tokenizer.encode(self.observation_text(observation, turn_closed), add_special_tokens=False))

    def observation_text(self, observation: list[Message], turn_closed: bool) -> str:
        """The text ``observation_ids`` tokenises. Raises ``ValueError`` as ``observation_ids``."""
        full = self._render(_PROBE + list(observation), add_generation_prompt=True)
        if not full.startswith(self._probe):
            raise ValueError("the chat template renders earlier messages differently once an observation follows; "
                             "observations cannot be appended token-exactly")
        return self._head(turn_closed) + full[len(self._probe):]

    def message_spans(self, observation: list[Message], turn_closed: bool) -> list[tuple[int, int]]:
        """The ``[start, end)`` character span of each observation message's rendering in ``observation_text`` (the
        rest is scaffold: the turn's end, the next assistant header). Renders the template once per message.

        Raises ``ValueError`` as ``observation_ids``."""
        spans, start = [], len(self._head(turn_closed))
        for i in range(len(observation)):
            upto = self._render(_PROBE + list(observation[:i + 1]), add_generation_prompt=False)
            if not upto.startswith(self._probe):
                raise ValueError("the chat template renders earlier messages differently once an observation "
                                 "follows; observations cannot be appended token-exactly")
            spans.append((start, len(self._head(turn_closed)) + len(upto) - len(self._probe)))
            start = spans[-1][1]
        return spans

    def _head(self, turn_closed: bool) -> str:
        """Template text between a model turn's last sampled token and the first observation message."""
        return ("" if turn_closed else self.end_text) + self.after_end


@dataclass
class Episode:
    """One finished (or broken) episode, in trajectory form. Shapes: ``T`` response tokens, ``S`` spans, ``K``
    turns; ``token_ids``/``logprobs``/``loss_mask`` ``[T]``, spans ``[S]``, ``turn_starts`` ``[K]``."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Behaviour logprob of each model token (natural log, after temperature); 0.0 on observation tokens."""
    loss_mask: list[int] = field(default_factory=list)
    version_span_starts: list[int] = field(default_factory=list)
    version_span_versions: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    """``"length"`` when the episode was cut (``max_turns``, ``max_tokens``, or a last turn cut at its budget)."""
    episode_end: str = ""
    """``"done"`` | ``"max_turns"`` | ``"max_tokens"`` (``proto.trajectory.EPISODE_ENDS``)."""
    error: str = ""
    """``""``, or why the episode broke (``"episode-env_error: ..."``, ``"episode-time_budget: ..."``)."""
    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    messages: list[Message] = field(default_factory=list)
    """The transcript as messages (for logs and evaluation; never re-tokenised)."""
    prompt_messages: list[Message] = field(default_factory=list)
    """The environment's first messages (what ``prompt_token_ids`` renders)."""
    completions: list[str] = field(default_factory=list)
    """Each model turn's text."""

    def add_turn(self, sample: Sample) -> None:
        """Append a model turn: its tokens (mask 1), logprobs and spans shifted to the response offset."""
        offset = len(self.token_ids)
        self.turn_starts.append(offset)
        for start, version in zip(sample.version_span_starts, sample.version_span_versions, strict=True):
            if self.version_span_versions and self.version_span_versions[-1] == version:
                continue  # the previous turn's version goes on
            self.version_span_starts.append(offset + start)
            self.version_span_versions.append(version)
        self.token_ids += sample.token_ids
        self.logprobs += sample.logprobs
        self.loss_mask += [1] * len(sample.token_ids)
        self.completions.append(sample.text)
        self.messages.append({"role": "assistant", "content": sample.text})

    def add_observation(self, ids: list[int], observation: list[Message]) -> None:
        """Append observation tokens (mask 0, logprob 0.0)."""
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.messages += observation

    def close_empty(self, version: int) -> None:
        """Give an episode without a model turn (broken before its first) the one turn and span every trajectory
        has: ``turn_starts [0]``, a span ``[0]`` of policy ``version``."""
        if not self.turn_starts:
            self.turn_starts, self.version_span_starts, self.version_span_versions = [0], [0], [version]

    @property
    def last_turn_token_ids(self) -> list[int]:
        """The last model turn's token ids (``[]`` for an episode without one): the tokens ``completions[-1]`` was
        decoded from, without the observation tokens after them."""
        if not self.completions:
            return []
        start = end = self.turn_starts[-1]
        while end < len(self.token_ids) and self.loss_mask[end] == 1:
            end += 1
        return self.token_ids[start:end]

    @property
    def context(self) -> list[int]:
        """``prompt + response`` ids: what the next turn is sampled from."""
        return self.prompt_token_ids + self.token_ids


def cap_content(observation: list[Message], max_chars: int) -> list[Message]:
    """``observation`` with each message's string content cut to ``max_chars`` (marker included)."""
    out = []
    for msg in observation:
        content = msg.get("content")
        if isinstance(content, str) and len(content) > max_chars:
            marker = f"[... {len(content) - max_chars} chars cut]"
            msg = {**msg, "content": content[: max(max_chars - len(marker), 0)] + marker}
        out.append(msg)
    return out


async def call(threads: EnvThreads, fn, *args, refusable: bool = True) -> Any:
    """Call a user method that may be ``async def`` or blocking (run by ``threads``: ``EnvThreads.call``, which
    raises ``EnvCallsStuckError`` while too many calls it abandoned still run, if ``refusable``)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await threads.call(fn, *args, refusable=refusable)
    return await result if inspect.isawaitable(result) else result


def check_messages(value: Any, what: str) -> list[Message]:
    """``value`` if it is a list of ``{"role": str, ...}`` dicts, else ``TypeError`` naming ``what`` and it."""
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        raise TypeError(f"{what} returned {value!r:.200}; expected a list of messages {{'role': ..., 'content': ...}}")
    return value


async def run_episode(engine, renderer: TurnRenderer, env: Environment, problem: Any, sampling: SamplingConfig,
                      config: EpisodeConfig, request_id: str, max_model_len: int, seed: int | None = None,
                      prompt_token_ids: list[int] | None = None, threads: EnvThreads | None = None) -> Episode:
    """Run ``env`` on ``problem`` to its end with ``engine`` (``RolloutEngine``: one sample per turn).

    Each turn samples at most ``sampling.max_new_tokens`` tokens (fewer when the context would pass
    ``max_model_len``); turn ``k`` uses seed ``seed + k``. ``prompt_token_ids``: the group's prompt (every
    episode of a group must start from it; a different first rendering breaks the episode). ``threads``: where the
    environment's blocking methods run, and the bound on the calls left running past a budget (``rollout.env_threads``;
    one per rollout, shared by its episodes); ``None``: this episode's own, bounded by ``config.max_stuck_calls``.

    Never raises for the environment's faults: an exception from ``reset``/``step``, a malformed answer, the time
    budget running out (a blocking call then running is abandoned, not waited for), or a call refused because too
    many abandoned calls still run (``"episode-env_stuck: ..."``) returns the episode so far with ``error`` set.
    Raises what the engine raises (``EngineFailedError``) and ``asyncio.CancelledError``.
    """
    episode = Episode(prompt_token_ids=list(prompt_token_ids or []))
    threads = threads if threads is not None else EnvThreads(config.max_stuck_calls)
    started = time.monotonic()
    try:
        async with asyncio.timeout(config.time_budget_s):
            await _play(engine, renderer, env, problem, sampling, config, request_id, max_model_len, seed, episode,
                        threads)
    except TimeoutError:
        episode.error = f"episode-time_budget: over {config.time_budget_s:g} s after {len(episode.turn_starts)} turns"
    except EnvCallsStuckError as exc:
        episode.error = f"episode-env_stuck: {exc}"
    except _EnvFault as exc:
        episode.error = f"episode-env_error: {exc}"
    finally:
        try:
            await asyncio.wait_for(call(threads, env.close, refusable=False), 10.0)
        except Exception as exc:  # noqa: BLE001 - user code; a close failure loses nothing generated
            log.warning("environment_close_failed", request_id=request_id, error=repr(exc)[:300])
    episode.close_empty(engine.version)
    if episode.error:
        log.info("episode_broken", request_id=request_id, error=episode.error[:300],
                 seconds=round(time.monotonic() - started, 2))
    return episode


class _EnvFault(Exception):
    """The environment raised or answered badly; the message says which method and what."""


async def _env(threads: EnvThreads, what: str, fn, *args):
    try:
        return await call(threads, fn, *args)
    except EnvCallsStuckError:
        raise  # not the environment's answer: ``run_episode`` names it
    except Exception as exc:  # noqa: BLE001 - user code: the episode records it and breaks
        raise _EnvFault(f"{what} raised {type(exc).__name__}: {exc}"[:2000]) from exc


async def _play(engine, renderer: TurnRenderer, env: Environment, problem, sampling: SamplingConfig,
                config: EpisodeConfig, request_id: str, max_model_len: int, seed: int | None, episode: Episode,
                threads: EnvThreads) -> None:
    first = await _env(threads, "reset", env.reset, problem)
    try:
        first = check_messages(first, "reset")
        ids = renderer.prompt_ids(first)
    except (TypeError, ValueError) as exc:
        raise _EnvFault(str(exc)) from exc
    if episode.prompt_token_ids and ids != episode.prompt_token_ids:
        raise _EnvFault("reset returned other first messages than the group's first episode (a group shares its "
                        "prompt): make reset deterministic in the problem")
    episode.prompt_token_ids, episode.messages, episode.prompt_messages = ids, list(first), list(first)
    for turn in range(config.max_turns):
        room = max_model_len - len(episode.context)
        if room < 1:
            episode.episode_end, episode.finish_reason = "max_tokens", "length"
            return
        turn_sampling = sampling.model_copy(update={"max_new_tokens": min(sampling.max_new_tokens, room)})
        (sample,) = await engine.generate(episode.context, 1, turn_sampling, request_id=f"{request_id}-t{turn}",
                                          seed=None if seed is None else seed + turn)
        episode.add_turn(sample)
        step = await _env(threads, "step", env.step, sample.text)
        if not isinstance(step, EnvStep):
            raise _EnvFault(f"step returned {step!r:.200}; expected rollout.environment.EnvStep")
        _count(episode, step)
        if step.done:
            episode.episode_end, episode.finish_reason = "done", sample.finish_reason
            return
        if turn + 1 == config.max_turns:
            break  # no observation after the last turn allowed: nothing would read it
        try:
            observation = cap_content(check_messages(step.observation, "step (observation)"),
                                      config.max_observation_chars)
        except TypeError as exc:
            raise _EnvFault(str(exc)) from exc
        closed = bool(sample.token_ids) and sample.token_ids[-1] == renderer.end_id
        obs_ids = renderer.observation_ids(observation, closed)
        if len(episode.context) + len(obs_ids) >= max_model_len:
            episode.episode_end, episode.finish_reason = "max_tokens", "length"
            return
        episode.add_observation(obs_ids, observation)
    episode.episode_end, episode.finish_reason = "max_turns", "length"


def _count(episode: Episode, step: EnvStep) -> None:
    """Add a step's reward and tool counts; a non-finite reward or bad counts break the episode."""
    reward = float(step.reward)
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise _EnvFault(f"step returned reward {step.reward!r}; expected a finite number")
    if not (0 <= step.tool_errors <= step.tool_calls):
        raise _EnvFault(f"step returned tool_calls {step.tool_calls}, tool_errors {step.tool_errors}; expected "
                        "0 <= tool_errors <= tool_calls")
    episode.reward += reward
    episode.tool_calls += step.tool_calls
    episode.tool_errors += step.tool_errors
