"""Live reward swaps (``gyre reward swap``): the request's one canonical form, its checks, the run's swap journal,
the rewards in force that every new rollout is created with, and the all-or-nothing apply over the fleet.

A swap names new rewards for some tasks of a running run, in the shape ``TaskSource.swap_reward`` takes: one
reward (``{name: ...}``, ``{function: "file.py:fn"}``, a bare name, or any other form ``RewardConfig`` accepts)
or a list of them (a weighted sum) for a single-task run, or ``{task: reward or list}``. It travels and is
journaled in its canonical form, ``{task: [reward, ...]}`` with every reward a ``RewardConfig`` dumped to JSON
(only what differs from its defaults) and every relative ``file.py`` and reward-model folder made absolute against
the CLI's directory.

All or nothing, in two phases: every running rollout first *prepares* the swap (builds the new rewards and checks
them against its task's entries, changing nothing); if one refuses or cannot be reached, every one that prepared
drops what it staged and the swap is reported failed with that rollout's reason; nothing was journaled. If all
prepared, the swap is appended to ``{run_dir}/{name}/reward_swaps.jsonl`` (``proto.journal``, fsync'd) and then
committed on each (committing a staged swap is a dict assignment and cannot refuse). A rollout that dies between
the two phases is restarted with the journaled rewards, like any rollout created afterwards: the supervisor's
restarts, ``gyre scale`` and a new driver of the run (``gyre run`` again) all create rollouts with
``RewardSwaps.task_config()``, the recipe's task with the journaled swaps applied in order.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml
from pydantic import ValidationError

from gyre.utils.callable_spec import resolve_file_spec
from gyre.proto.journal import Journal, read_journal
from gyre.rollout.rewards.base import RewardConfig
from gyre.rollout.tasks import TaskConfig

SWAP_JOURNAL = "reward_swaps.jsonl"
"""File name, under the run directory, of the journal of accepted swaps (``reward_swap`` events)."""

Swap = dict[str, list[dict]]
"""A canonical swap: ``{task: [RewardConfig as JSON, ...]}``."""


class RewardSwapError(ValueError):
    """A swap that cannot be applied; the message names the bad value and what was expected."""


def parse_swap_config(text: str, base: Path) -> Any:
    """The swap in ``text``: a YAML/JSON file's content if ``text`` names one (relative to ``base``), else
    ``text`` itself as YAML (``"math_exact"``, ``"{function: r.py:score}"``).

    Raises:
        RewardSwapError: the file or text is not valid YAML, or is empty.
    """
    path = base / Path(text).expanduser()
    source = f"file {path}" if path.is_file() else "inline config"
    try:
        data = yaml.safe_load(path.read_text() if path.is_file() else text)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise RewardSwapError(f"reward swap {source} is not valid YAML/JSON: {exc}") from None
    if data is None or data == {} or data == []:
        raise RewardSwapError(f"reward swap {source} is empty; expected a reward ({{name: ...}} or "
                              "{function: 'file.py:fn'}), a list of them, or {task: reward-or-list}")
    return data


def _is_one_reward(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, Mapping) and bool(value)
                                      and set(value) <= set(RewardConfig.model_fields))


def _reward(task: str, raw: Any, base: Path) -> dict:
    if isinstance(raw, Mapping) and isinstance(raw.get("function"), str):
        raw = {**raw, "function": resolve_file_spec(raw["function"], base)}
    if isinstance(raw, Mapping) and isinstance(raw.get("model"), str) and (base / raw["model"]).is_dir():
        raw = {**raw, "model": str((base / raw["model"]).resolve())}  # a folder; a Hub id stays as it is
    try:
        cfg = RewardConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'reward'}: {e['msg']}" for e in exc.errors())
        raise RewardSwapError(f"reward swap: task {task!r}: reward {raw!r} is invalid ({problems}); expected "
                              f"a RewardConfig with keys {sorted(RewardConfig.model_fields)}") from None
    return cfg.model_dump(mode="json", exclude_defaults=True)


def canonical_swap(config: Any, task: TaskConfig, base: Path) -> Swap:
    """``config`` (any form ``TaskSource.swap_reward`` takes) as ``{task: [reward dicts]}`` for ``task``'s tasks.

    Raises:
        RewardSwapError: a single reward for a mixture, a task the run does not have, an empty list, or a reward
            that ``RewardConfig`` refuses (each named).
    """
    names = list(task.components())
    if _is_one_reward(config) or isinstance(config, (list, tuple)):
        if len(names) != 1:
            raise RewardSwapError(f"reward swap: this run mixes tasks {names}; expected {{task: reward}} naming "
                                  "the tasks to change")
        config = {names[0]: config}
    if not isinstance(config, Mapping):
        raise RewardSwapError(f"reward swap {config!r}: expected a reward, a list of rewards or {{task: reward}}")
    out: Swap = {}
    for name, rewards in config.items():
        if name not in names:
            raise RewardSwapError(f"reward swap: unknown task {name!r}; this run's tasks: {names}")
        rewards = list(rewards) if isinstance(rewards, (list, tuple)) else [rewards]
        if not rewards:
            raise RewardSwapError(f"reward swap: task {name!r}: an empty list; expected at least one reward")
        out[name] = [_reward(name, r, base) for r in rewards]
    return out


def check_swap(swap: Swap, task: TaskConfig) -> dict[str, str]:
    """Build the swap's rewards as a rollout would: functions imported and their signatures checked, and, unless a
    task's prompts come from the Hub (not fetched here), each reward checked against its task's first held-out
    entry. Returns ``{task: reward_fn_version}`` the run would have (of the swapped tasks).

    Raises:
        RewardSwapError: what ``TaskSource`` raised, with the message it gave; a reward model for a run (``task``: its
            recipe's) without a reward-model service.
    """
    from gyre.rollout.dataset_files import is_hub
    from gyre.rollout.rewards.combined import make_reward_set
    from gyre.rollout.tasks import TaskSource, reward_configs

    models = [r["model"] for rewards in swap.values() for r in rewards if r.get("model")]
    if models and not any(c.model for name, comp in task.components().items() for c in reward_configs(name, comp)):
        raise RewardSwapError(f"reward swap refused: {models[0]!r} is a reward model, and this run has no reward-model "
                              "service (its recipe's rewards name no model); a run swaps reward models only when it "
                              "was started with one")
    try:
        if any(c.dataset is not None and is_hub(c.dataset.path, c.dataset.format)
               for c in task.components().values()):
            return {name: make_reward_set(rewards).version for name, rewards in swap.items()}
        staged = TaskSource(task).prepare_swap(swap)
    except (ValueError, KeyError) as exc:  # UnknownRewardError, RewardImportError, a misfit: all ValueErrors
        raise RewardSwapError(f"reward swap refused: {exc.args[0] if exc.args else exc}") from None
    return {name: rewards.version for name, rewards in staged.items()}


def apply_to_task(task: TaskConfig, rewards: Swap) -> TaskConfig:
    """``task`` with each named task's ``reward``/``rewards`` replaced by ``rewards[task]``."""
    if not rewards:
        return task
    data = task.model_dump(mode="json")
    holders = data["mixture"] if task.mixture is not None else {next(iter(task.components())): data}
    for name, new in rewards.items():
        holders[name].update(reward=None, rewards=new)
    return TaskConfig.model_validate(data)


class RewardSwaps:
    """The swaps of one run: those journaled in ``{run_dir}/{name}/reward_swaps.jsonl`` (read at construction: a
    new driver of the run goes on with them) and the ones it applies.

    Raises:
        proto.journal.JournalError: a corrupt line in an existing journal (named).
    """

    def __init__(self, task: TaskConfig, journal_path: Path) -> None:
        self.task, self.path = task, Path(journal_path)
        self.in_force: Swap = {}
        """``{task: [reward dicts]}`` of every task swapped so far (the latest swap of each)."""
        self.count = 0
        """Swaps accepted in this run (journaled), over all its drivers."""
        self.versions: dict[str, str] = {}
        """``{task: reward_fn_version}`` the latest accepted swap reported (empty before one)."""
        self._journal: Journal | None = None
        events = read_journal(self.path).events if self.path.is_file() else []
        for event in events:
            if event["event"] == "reward_swap":
                self.in_force.update({t: r for t, r in event["rewards"].items() if t in task.components()})
                self.count, self.versions = self.count + 1, event.get("versions", {})

    def task_config(self) -> TaskConfig:
        """The task every rollout is created with now: the recipe's, with the swaps in force."""
        return apply_to_task(self.task, self.in_force)

    def record(self, swap_id: int, swap: Swap, versions: dict[str, str]) -> None:
        """Journal an accepted swap (fsync'd) and put it in force for rollouts created afterwards.

        Raises:
            OSError: the journal cannot be written (the swap is then not applied).
        """
        if self._journal is None:
            self._journal = Journal(self.path)
        self._journal.append({"event": "reward_swap", "id": swap_id, "rewards": swap, "versions": versions,
                              "time": time.time()})
        self.in_force.update(swap)
        self.count, self.versions = self.count + 1, versions


def _reason(exc: BaseException) -> str:
    """A refusal's message: the rollout's own exception inside a ``RayTaskError``."""
    cause = getattr(exc, "cause", None)
    exc = cause if isinstance(cause, BaseException) else exc
    return f"{type(exc).__name__}: {exc.args[0] if exc.args else exc}"


def apply_swap(swaps: RewardSwaps, swap_id: int, swap: Swap, rollouts: list, get: Callable,
               timeout_s: float = 60.0) -> dict:
    """Apply ``swap`` to every rollout in ``rollouts`` (``Service``s) or to none (see the module docstring).
    ``get``: ``ray.get``. Returns ``{"ok", "versions" ({task: version} in force), "rollouts" (their names),
    "error" (why it was refused, naming the rollout), "warnings" (rollouts that died after preparing: they are
    restarted with the journaled rewards)}``; a refusal raises nothing."""
    prepared, versions, warnings = [], {}, []
    try:
        swap = canonical_swap(swap, swaps.task, Path("/"))  # canonical from the CLI: checks the task names again
        for svc in rollouts:
            try:
                versions = get(svc.handle.prepare_reward.remote(swap), timeout=timeout_s)
            except Exception as exc:  # a refusal (RayTaskError wrapping its ValueError), or a dead/hung rollout
                raise RewardSwapError(f"{svc.name} refused the reward swap: {_reason(exc)}") from None
            prepared.append(svc)
        swaps.record(swap_id, swap, versions)
    except (RewardSwapError, OSError) as exc:
        for svc in prepared:
            _call(get, svc, "abort_reward", timeout_s, warnings)
        return {"ok": False, "versions": swaps.versions, "rollouts": [], "error": str(exc), "warnings": warnings}
    for svc in rollouts:  # a staged swap cannot refuse its commit; only a rollout that died meanwhile fails here
        _call(get, svc, "commit_reward", timeout_s, warnings)
    return {"ok": True, "versions": swaps.versions, "rollouts": [s.name for s in rollouts], "error": None,
            "warnings": warnings}


def _call(get: Callable, svc, method: str, timeout_s: float, warnings: list[str]) -> None:
    try:
        get(getattr(svc.handle, method).remote(), timeout=timeout_s)
    except Exception as exc:  # it died or hangs: the supervisor restarts it, with the rewards in force
        warnings.append(f"{svc.name}: {method} failed ({_reason(exc)}); it is restarted with the rewards in force")
