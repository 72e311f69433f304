"""Everything ``gyre check`` reads from a finished run directory, loaded without changing it.

Layout of ``runs/<name>/`` (``recipe.out_dir``) that matters here::

    recipe.json                 the recipe (its ``replay`` section gives the replay config; read by
                                ``services.control.outputs.run_dir``)
    replay/                     replay's WAL + snapshots (or ``replay.dir`` from the recipe); a sharded replay
                                (``replay.shards: K``) has one ``shard-{k}/`` per shard, each restored alone
    learner_journal.jsonl       the learner's journal (``learner.run_journal``)
    rollouts/rollout-{i}.jsonl  each rollout's journal (``services.common.replay_links.acked_event``, weights)

Replay's durable state is restored offline into memory with ``replay.offline.inspect_dir`` (read-only:
it reads the snapshot and WAL and writes nothing — no quarantine moves, no WAL truncation).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from gyre.proto.journal import JournalError, read_journal
from gyre.replay.config import ReplayConfig
from gyre.replay.types import Counters
from gyre.services.control.outputs.run_dir import RunDirError, replay_config, replay_shard_configs

LEARNER_JOURNAL = "learner_journal.jsonl"
ROLLOUT_JOURNALS = "rollouts"




@dataclass(frozen=True)
class StoredGroup:
    """A group replay holds (pooled, leased or excluded) after restore."""

    group_id: str
    prompt_index: int
    state: str
    """``pooled``, ``leased`` or ``excluded`` (``replay.types``)."""
    num_rows: int


@dataclass
class RunRecords:
    """A run's journals and replay's restored state, as plain values."""

    run_dir: Path
    replay_config: ReplayConfig
    learner_events: list[dict]
    """The learner journal's events, in file order."""
    rollout_events: dict[str, list[dict]]
    """Rollout id (journal file stem) → its events, in file order."""
    stored: dict[str, StoredGroup]
    """group_id → the group replay holds."""
    ledger_completed: set[int]
    """Prompt indices replay's prompt ledger counts complete."""
    counters: Counters
    """Replay's lifetime counters (rows for ``dropped_stale_total``, groups for ``evicted_groups_total``)."""
    torn_tails: list[str] = field(default_factory=list)
    """Journals whose unterminated last line (a crash mid-append) was skipped."""
    ledger_leased: dict[int, str] = field(default_factory=dict)
    """Prompt indices issued but not complete when replay stopped → the consumer (rollout) holding the lease, or
    ``""`` for one expired and queued for re-issue: a resumed run issues them again."""


def _replay_config(run_dir: Path) -> ReplayConfig:
    cfg = replay_config(run_dir)
    for shard in replay_shard_configs(run_dir):
        if not Path(shard.dir).is_dir():
            raise RunDirError(f"{run_dir}: replay directory {shard.dir} does not exist")
    return cfg


def _journal(path: Path, torn: list[str]) -> list[dict]:
    try:
        got = read_journal(path)
    except JournalError as exc:
        raise RunDirError(str(exc)) from exc
    except OSError as exc:
        raise RunDirError(f"journal {path} cannot be read: {exc}") from exc
    if got.torn_tail:
        torn.append(str(path))
    return got.events


def _replay_state(cfg: ReplayConfig) -> tuple[dict[str, StoredGroup], set[int], dict[int, str], Counters]:
    """The state of one replay shard (or of the unsharded replay), restored offline from ``cfg.dir``."""
    from gyre.replay.offline import inspect_dir

    try:
        buffer = inspect_dir(cfg, read_only=True)
    except Exception as exc:  # RestoreError or an unreadable file: the checker cannot judge this run
        raise RunDirError(f"replay directory {cfg.dir} does not restore: {type(exc).__name__}: {exc}") from exc
    state = buffer.state
    stored = {g.group_id: StoredGroup(g.group_id, g.prompt_index, g.state, g.num_rows)
              for g in state.store.groups.values()}
    ledger = state.ledger.state_dict()
    completed = set(range(cfg.shard, ledger["done_below"], cfg.shards)) | {int(i) for i in ledger["done_above"]}
    leased = {int(i): str(consumer) for i, consumer, _, _ in ledger["leases"]} | {int(i): "" for i, _ in ledger["expired"]}
    return stored, completed, leased, state.counters


def load_run(run_dir: str | Path) -> RunRecords:
    """Read ``run_dir``'s recipe, journals and replay state.

    Raises:
        RunDirError: no ``recipe.json``, no replay directory, no learner journal, no rollout journal (unless it
            trained from a recording: ``replay.source``), a corrupt journal line (named), or replay's directory
            does not restore.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is not a run directory (it does not exist or is not a directory)")
    cfg = _replay_config(run_dir)
    torn: list[str] = []
    learner_path = run_dir / LEARNER_JOURNAL
    if not learner_path.is_file():
        raise RunDirError(f"{run_dir}: no learner journal {learner_path.name} (a run made before journals "
                          "existed, or the learner never started)")
    learner = _journal(learner_path, torn)
    rollout_paths = sorted((run_dir / ROLLOUT_JOURNALS).glob("*.jsonl"))
    if not rollout_paths and cfg.source is None:  # a run trained from a recording may start no rollout
        raise RunDirError(f"{run_dir}: no rollout journal under {ROLLOUT_JOURNALS}/ (no rollout ever started?)")
    rollouts = {p.stem: _journal(p, torn) for p in rollout_paths}
    stored, completed, leased, counters = {}, set(), {}, Counters()
    for shard in replay_shard_configs(run_dir):  # each shard holds only its own prompts: their union is replay's
        s, c, leases, n = _replay_state(shard)
        stored.update(s)
        completed |= c
        leased.update(leases)
        _add_counters(counters, n)
    return RunRecords(run_dir, cfg, learner, rollouts, stored, completed, counters, torn, leased)


def _add_counters(total: Counters, part: Counters) -> None:
    """Add one shard's lifetime counters into ``total`` (per-version maps key by key)."""
    for f in fields(Counters):
        mine, theirs = getattr(total, f.name), getattr(part, f.name)
        if isinstance(mine, dict):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        else:
            setattr(total, f.name, mine + theirs)
