"""A GRPO group of multi-turn episodes: ``group_size`` environments on one problem, run concurrently, as
trajectory rows (``proto.trajectory`` version 4: loss mask, turn starts, tool counts).

The rollout worker uses this instead of one ``engine.generate(n=group_size)`` call when the recipe sets
``rollout.environment`` (``rollout.environment.EnvironmentConfig``).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from typing import Any

from gyre.utils.callable_spec import CallableSpecError, load_callable
from gyre.proto.timeline import label
from gyre.proto.trajectory import Trajectory, make_ids
from gyre.rollout.config import SamplingConfig
from gyre.rollout.agents.env_threads import EnvCallsStuckError, EnvThreads
from gyre.rollout.agents.environment import Environment, EnvironmentConfig
from gyre.rollout.agents.episode import Episode, TurnRenderer, run_episode
from gyre.rollout.rewards.base import Group, RewardResult


class EnvironmentLoadError(ValueError):
    """``rollout.environment.factory`` names nothing loadable; the message names the spec and why."""


class EpisodeRunner:
    """Runs the groups of one rollout's environment.

    Args:
        config: the recipe's ``rollout.environment``.
        tokenizer: the policy's HF tokenizer (its chat template renders prompts and observations).

    Raises:
        EnvironmentLoadError: the factory does not import or is not callable.
        ValueError: the chat template cannot be diffed (``TurnRenderer``).
    """

    def __init__(self, config: EnvironmentConfig, tokenizer) -> None:
        try:
            self.factory, source = load_callable(config.factory)
        except CallableSpecError as exc:
            raise EnvironmentLoadError(f"rollout.environment.factory {config.factory!r}: {exc}") from exc
        self.config = config
        self.renderer = TurnRenderer(tokenizer)
        self.threads = EnvThreads(config.max_stuck_calls)
        """Where the environments' blocking methods run; bounds the calls left running past a time budget."""
        self.version = f"env:{config.factory}@{hashlib.sha256(source).hexdigest()[:12]}"
        """Recorded as each row's ``reward_fn_version``: the environment scores the episodes."""

    def _make(self) -> Environment:
        env = self.factory(**self.config.kwargs)
        if not all(callable(getattr(env, m, None)) for m in ("reset", "step")):
            raise TypeError(f"{self.config.factory} returned {type(env).__name__}, which has no reset/step; "
                            "expected a rollout.environment.Environment")
        return env

    def heldout(self, task) -> list:
        """The held-out problems evaluation plays (``rollout.agents.episode_eval``): ``task``'s (``TaskSource.heldout``)."""
        return task.heldout()

    def fallback_prompt(self, problem, prompt_ids) -> list[int]:
        """The prompt of a group none of whose episodes started: ``prompt_ids(problem)`` (the task's rendering)."""
        return prompt_ids(problem)

    async def close(self) -> None:
        """Nothing to release (each episode closes its environment)."""

    @property
    def task_reward(self) -> bool:
        """Whether the task's reward functions also score the episodes (``EnvironmentConfig.task_reward``)."""
        return self.config.task_reward

    async def run_group(self, engine, problem: Any, n: int, sampling: SamplingConfig, request_id: str,
                        max_model_len: int, seed: int | None, fallback_prompt: list[int],
                        prompt_index: int = 0) -> list[Episode]:
        """``n`` episodes on ``problem`` (episode ``i`` seeds its turn ``k`` with ``seed + i * max_turns + k``;
        ``prompt_index`` is not used: the problem is the environment's input).

        Episodes whose first messages render differently from the group's majority, and episodes whose
        environment could not be made, are broken (``error``) with the group's prompt and no response; a group
        none of whose episodes started uses ``fallback_prompt``. Raises what the engine raises."""
        turns = self.config.max_turns

        async def one(i: int) -> Episode:
            try:  # no environment is made while too many blocking calls are stuck (rollout.env_threads)
                self.threads.admit("a new episode")
            except EnvCallsStuckError as exc:
                return Episode(prompt_token_ids=[], error=f"episode-env_stuck: {exc}")
            try:
                env = self._make()
            except Exception as exc:  # noqa: BLE001 - user code
                return Episode(prompt_token_ids=[], error=f"episode-env_error: factory raised "
                                                           f"{type(exc).__name__}: {exc}"[:2000])
            return await run_episode(engine, self.renderer, env, problem, sampling, self.config,
                                     f"{request_id}-e{i}", max_model_len,
                                     None if seed is None else seed + i * turns, threads=self.threads)

        episodes = list(await asyncio.gather(*(one(i) for i in range(n))))
        return share_prompt(episodes, fallback_prompt, engine.version,
                            "reset returned other first messages than the group's other episodes")

    def task_group(self, episodes: list[Episode], entry: dict) -> Group:
        """What the task's reward functions score (``EnvironmentConfig.task_reward``): each episode's last model
        turn as the completion (``""`` for one that never generated), its token ids as ``completion_ids`` (``[]``
        then) and its first messages as the prompt."""
        return Group([e.completions[-1] if e.completions else "" for e in episodes],
                     [e.prompt_messages for e in episodes], entry, [e.last_turn_token_ids for e in episodes])

    def rows(self, episodes: list[Episode], prompt_index: int, attempt: int, task: str, rollout_id: str,
             timeline: int, task_scores: list[RewardResult] | None = None) -> list[Trajectory]:
        """Trajectory rows of a group's episodes (sample ``i`` = episode ``i``), rewarded with the environment's
        reward plus ``task_scores[i]`` (the task's reward functions). A broken episode (or one whose task score
        failed) keeps its tokens for inspection but carries the reason in ``reward_error`` and reward 0.0 (never
        trained on)."""
        return episode_rows(episodes, self.version, prompt_index, attempt, task, rollout_id, timeline, task_scores)


def share_prompt(episodes: list[Episode], fallback_prompt: list[int], version: int, why: str) -> list[Episode]:
    """A GRPO group shares one prompt: the episodes whose prompt differs from the group's majority (``why`` says how
    it came about) are replaced by broken ones with that prompt and no response; a group none of whose episodes
    started uses ``fallback_prompt``. Every episode ends with at least one turn start and span (``version``)."""
    started = Counter(tuple(e.prompt_token_ids) for e in episodes if e.prompt_token_ids)
    prompt = list(started.most_common(1)[0][0]) if started else list(fallback_prompt)
    for i, e in enumerate(episodes):
        if e.prompt_token_ids != prompt:
            error = e.error or f"episode-env_error: {why} (a group shares its prompt): make it deterministic"
            e = episodes[i] = Episode(prompt_token_ids=prompt, error=error)
        e.close_empty(version)
    return episodes


def episode_rows(episodes: list[Episode], reward_fn_version: str, prompt_index: int, attempt: int, task: str,
                 rollout_id: str, timeline: int, task_scores: list[RewardResult] | None = None) -> list[Trajectory]:
    """Trajectory rows of a group's episodes (``EpisodeRunner.rows``); ``reward_fn_version``: who scored them."""
    rows = []
    for i, e in enumerate(episodes):
        tid, gid = make_ids(prompt_index, i, attempt)
        score = task_scores[i] if task_scores is not None else None
        reward, error = episode_reward(e, score)
        version = reward_fn_version if score is None else f"{reward_fn_version}+{score.version}"
        rows.append(Trajectory(
            trajectory_id=tid, group_id=gid, prompt_index=prompt_index, sample_index=i, attempt=attempt,
            task=task, prompt_token_ids=e.prompt_token_ids, response_token_ids=e.token_ids,
            behaviour_logprobs=e.logprobs, reward=reward, reward_error=error,
            finish_reason=e.finish_reason, version_span_starts=e.version_span_starts,
            version_span_versions=e.version_span_versions, reward_fn_version=version,
            rollout_id=rollout_id, created_at=time.time(),
            policy_timeline=label(e.version_span_versions[-1], timeline), loss_mask=e.loss_mask,
            turn_starts=e.turn_starts, tool_calls=e.tool_calls, tool_errors=e.tool_errors,
            episode_end="" if e.error else e.episode_end))
    return rows


def episode_reward(episode: Episode, score: RewardResult | None) -> tuple[float, str]:
    """``(reward, reward_error)`` of an episode: the environment's reward plus the task's ``score`` (``None``: not
    scored by the task), or ``(0.0, why)`` when the episode broke or its task score failed."""
    error = episode.error or (score.error if score is not None else "")
    return (0.0, error) if error else (episode.reward + (score.reward if score is not None else 0.0), "")
