"""Multi-turn environments: the protocol an agent task implements, and the limits an episode runs under.

An episode (``rollout.agents.episode.run_episode``) alternates model turns and environment steps::

    messages = env.reset(problem)            # the first messages (system, user): the prompt
    loop:                                    # at most EpisodeConfig.max_turns model turns
        model turn (tokens the engine sampled)
        step = env.step(model's text)        # tool results / feedback as messages, a reward, done?
        if step.done: stop
        observation tokens appended          # never a re-rendered transcript

The shape is gym's (``reset`` / ``step``) as verl's agent loop, AReaL's and ``verifiers``' multi-turn
environments use it. One ``Environment`` object serves one episode: the rollout makes a fresh one per episode
from the recipe's factory, so per-episode state lives on ``self``. ``reset``, ``step`` and ``close`` may be plain
or ``async def``; plain ones run in a worker thread (a blocking tool call does not stall generation), abandoned
when the episode's time budget runs out during the call, and bounded (``EpisodeConfig.max_stuck_calls``,
``rollout.env_threads``).

The episode's reward is the sum of its steps' rewards. An environment that raises, or an episode over its time
budget, ends the episode as *broken*: its reason is recorded (``reward_error`` ``"episode-env_error: ..."`` /
``"episode-time_budget: ..."``) and the learner trains on none of its tokens (``learner.batch``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

Message = dict[str, Any]
"""A chat message as the tokenizer's chat template takes it: ``{"role": ..., "content": ...}``."""


@dataclass(frozen=True)
class EnvStep:
    """What the environment answers to one model turn."""

    observation: list[Message] = field(default_factory=list)
    """Messages appended after the model's turn (a ``tool`` result, a ``user`` follow-up); rendered with the
    policy's chat template and appended as tokens with loss mask 0. Ignored when ``done``."""
    reward: float = 0.0
    """Reward of this step (finite); the episode's reward is the sum over its steps."""
    done: bool = False
    """The episode is over (answered, solved, or given up by the environment)."""
    tool_calls: int = 0
    """Tool calls the model's turn made (counted into the trajectory's ``tool_calls``)."""
    tool_errors: int = 0
    """How many of them failed (unknown tool, bad arguments, crash, timeout)."""


class Environment(ABC):
    """One episode of a multi-turn task. Subclass it and name the class (or any factory returning one) in the
    recipe; see the module docstring for the loop. Methods may be ``async def``."""

    @abstractmethod
    def reset(self, problem: Any) -> list[Message]:
        """Start an episode on ``problem`` (``rollout.tasks.Problem``: ``question``, ``entry``, ``task``) and return
        its first messages. Every episode of one GRPO group gets the same problem and must return the same
        messages (the group shares its prompt tokens)."""

    @abstractmethod
    def step(self, completion: str) -> EnvStep:
        """Answer the model's turn ``completion`` (its text, special tokens skipped)."""

    def close(self) -> None:
        """Release what the episode held (sandboxes, files); called once after the last step, also when the
        episode broke. Errors here are logged, never raised into the rollout."""


class EpisodeConfig(BaseModel):
    """Limits of one multi-turn episode (the recipe's ``rollout.environment`` section, with the factory)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int = Field(default=4, ge=1, le=256)
    """Most model turns per episode; an episode that reaches it ends with ``episode_end "max_turns"`` and
    ``finish_reason "length"`` (a model that never stops calling tools is cut here)."""
    time_budget_s: float = Field(default=300.0, gt=0)
    """Wall-clock seconds one episode may take, generation and environment together; past it the episode is
    broken (``"episode-time_budget: ..."``, not trained on). A plain (blocking) ``reset``/``step``/``close`` still
    running then is abandoned: its thread runs on until the call returns (Python cannot stop a thread)."""
    max_stuck_calls: int = Field(default=8, ge=1)
    """Most abandoned blocking calls still running, per rollout (``rollout.env_threads``); while that many run, every
    new ``reset``/``step``/``close`` is refused and its episode broken (``"episode-env_stuck: ..."``), until one
    returns. A rollout stuck at this bound needs a restart (that ends the calls)."""
    max_observation_chars: int = Field(default=4096, ge=16)
    """Longest content of one observation message, in characters; longer content (a tool printing megabytes)
    is cut to this with a ``[... N chars cut]`` marker before it is tokenised."""


class EnvironmentConfig(EpisodeConfig):
    """The recipe's ``rollout.environment``: which environment runs each episode, and the episode limits.

    With it set, every group is ``group_size`` episodes of ``factory(**kwargs)`` environments on the leased
    problem (``rollout.agents.agent_group``) instead of single completions, scored by the environments' rewards plus,
    with ``task_reward``, the task's reward functions on each episode's final answer."""

    factory: str
    """``"pkg.module:Name"`` or ``"path/to/file.py:Name"`` (``utils.callable_spec``): a class or function that,
    called with ``kwargs``, returns a fresh ``Environment`` (one per episode)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of ``factory`` (plain YAML values)."""
    task_reward: bool = True
    """Also score each episode's last model turn with the task's reward functions (TRL's ``reward_funcs``
    convention: ``completions`` are the final answers, ``prompts`` the episodes' first messages) and add it to the
    environment's reward. False: the environment's step rewards alone."""

    @field_validator("factory")
    @classmethod
    def _spec(cls, value: str) -> str:
        from gyre.utils.callable_spec import CallableSpecError, split_spec

        try:
            split_spec(value)
        except CallableSpecError as exc:
            raise ValueError(f"rollout.environment.factory {value!r}: {exc}; expected 'pkg.module:Name' or "
                             "'path/to/file.py:Name'") from exc
        return value


class VerifiersConfig(BaseModel):
    """The recipe's ``rollout.verifiers``: which ``verifiers`` environment plays each episode."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    taskset: str
    """The verifiers taskset id: an importable module (or ``verifiers.v1.tasksets.<id>``) exporting one
    ``vf.Taskset`` subclass, and optionally its ``vf.Env`` subclass, via ``__all__`` (verifiers' own rule); or a
    ``path/to/taskset.py`` file (made absolute when the recipe loads; its folder goes on ``sys.path``, its stem is
    the id)."""
    env: dict[str, Any] = Field(default_factory=dict)
    """The rest of the verifiers env config (its ``[env]`` TOML block as YAML): ``taskset`` fields beyond the id,
    each role's ``harness``/``runtime``/``max_turns``, ``timeout``. A role's unset ``harness``/``runtime`` are
    ``rollout.agents.verifiers_env.LOCAL_AGENT``'s (verifiers' ``null`` chat loop in a local subprocess)."""
    heldout: int = Field(default=0, ge=0)
    """The taskset's last ``heldout`` tasks are held out: never trained on, played by held-out evaluation (one
    greedy episode each, plus ``eval.n_samples`` sampled) as the set named by ``taskset``. Training plays task
    ``prompt_index % (len(tasks) - heldout)``."""
    renderer: dict[str, Any] | None = None
    """The ``renderers`` config verifiers renders prompts with (``{"name": "qwen3"}``, ...; prime-rl's
    ``renderer``). ``None``: ``rollout.agents.verifiers_renderer.TemplateBridgeRenderer``, the model's own chat template
    with a token-exact bridge between turns."""
    time_budget_s: float = Field(default=600.0, gt=0)
    """Wall-clock seconds one episode may take once it started; past it the episode is broken
    (``"episode-time_budget: ..."``)."""
    max_concurrent: int = Field(default=8, ge=1)
    """Most episodes one rollout plays at once (each runs a harness program: a process); the others wait their turn,
    not counted in their time budget. Training asks for ``groups_in_flight × group_size``, evaluation for every
    held-out task at once."""

    @field_validator("taskset")
    @classmethod
    def _taskset(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("rollout.verifiers.taskset is empty; expected a verifiers taskset id (a module name)")
        if value.endswith(".py"):
            path = Path(value).expanduser().resolve()
            if not path.is_file():
                raise ValueError(f"rollout.verifiers.taskset {value!r}: no such file ({path})")
            return str(path)
        return value

    @property
    def taskset_id(self) -> str:
        """The id verifiers imports: ``taskset``, or a file's stem."""
        return Path(self.taskset).stem if self.taskset.endswith(".py") else self.taskset
