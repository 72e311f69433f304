"""Invariant checker over a finished run (``gyre check RUN_DIR``): what must hold however often any
service crashed and was restarted.

Inputs (``services.cli.run_records``): the learner journal (``commit``/``resume`` events), every rollout's
journal (``acked`` inserts, applied ``weights`` versions) and replay's durable state restored offline.

Definitions:

- *acknowledged*: a group some rollout journaled as ``accepted`` by replay (a ``duplicate`` ack is a
  retry of a group replay already had; a ``dropped_stale`` ack is a group the staleness gate refused at
  insert — acknowledged as delivered, never stored, counted in ``dropped_stale_at_insert_groups``).
- *trained*: the groups of every ``commit`` event that no later resume rolled back. A ``resume`` at step
  ``r`` invalidates the ``commit`` events journaled before it with step ``> r``: their leases were acked
  to replay, but the model that learned from them was discarded.
- *stored*: groups replay holds now (pooled, leased or excluded).

Violations (``KINDS``), each with a detail naming the group, prompt, version or step:

- ``lost``: an acknowledged group neither stored nor trained. A group trained only by a rolled-back
  checkpoint is lost (the detail says which commit and which resume). Replay deletes groups without
  naming them in two cases it counts: the staleness gate (``dropped_stale_total``, rows, in ``drop`` mode,
  minus the rows dropped at insert; in ``exclude`` mode only ``dead_timeline_deleted_total``, the groups of a
  crashed learner's timeline deleted at the resumed learner's ``Rejoin``) and capacity eviction
  (``evicted_groups_total``). Missing groups are
  excused against those counters (staleness first, by rows; then eviction, one group each) and reported in
  ``counts["dropped_stale_groups"]`` / ``counts["evicted_groups"]``; a missing group beyond what the
  counters explain is lost. Rolled-back groups are never excused.
- ``trained_twice``: a group in more valid ``commit`` events than replay's ``max_times_sampled`` allows
  (1 by default: trained exactly once).
- ``prompt_not_once``: a prompt index with more than one group that completed it (accepted or dropped
  stale at insert, across rollouts — the same group accepted twice counts twice: replay lost it in between);
  a prompt replay's ledger counts complete with no group evidence at all (no ack of any kind, not stored,
  not trained); or an accepted group whose prompt the ledger does not count complete.
- ``version_regressed``: within one rollout process (pid) and one timeline (``proto.timeline``), a
  ``weights`` version below an earlier one (across a restart — a new pid — or a timeline switch — the
  learner resumed from an older checkpoint — a lower version is legitimate).
- ``resume_not_newest``: a resume at a step below the newest valid ``commit`` journaled before it, unless
  that step is listed in the resume's ``rejected`` (it failed verification).

Not violations, but counted: groups trained with no rollout ack journaled (a rollout killed between the
ack and its journal append), ``mixed`` acks of multi-group inserts, torn journal tails.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gyre.services.cli.run_records import RunDirError, RunRecords, load_run

__all__ = ["KINDS", "InvariantReport", "RunDirError", "Violation", "check_run", "check_records"]

KINDS = ("lost", "trained_twice", "prompt_not_once", "version_regressed", "resume_not_newest")


@dataclass
class Violation:
    """One broken invariant."""

    kind: str
    """One of ``KINDS``."""
    detail: str
    """What broke, naming the group / prompt / version / step."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"violation kind {self.kind!r} is not one of {KINDS}")


@dataclass
class InvariantReport:
    """The checker's verdict on one run."""

    violations: list[Violation] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    """acknowledged_groups, trained_groups, in_replay_groups, lost_groups, duplicates_trained,
    prompts_completed, resumes, rollout_version_events, and the excuse/diagnostic counts (module doc)."""

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "violations": [asdict(v) for v in self.violations],
                           "counts": self.counts}, indent=2, sort_keys=True)


@dataclass
class _Acks:
    """The rollout journals' ``acked`` events, by what replay did with each group."""

    accepted: dict[str, list[tuple[str, int, int]]] = field(default_factory=lambda: defaultdict(list))
    """group_id → [(rollout, prompt_index, rows)] per accepted ack."""
    stale_at_insert: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    duplicate_prompts: set[int] = field(default_factory=set)
    mixed: dict[str, int] = field(default_factory=dict)
    """group_id → prompt of groups in multi-group inserts whose outcome the row counts do not tell."""
    duplicate_acks: int = 0


@dataclass
class _Training:
    valid: list[dict] = field(default_factory=list)
    """``commit`` events no resume rolled back, in journal order."""
    rolled_back: dict[str, str] = field(default_factory=dict)
    """group_id → why (which commit, which resume) for groups of invalidated commits."""
    resumes: int = 0


def _prompt_of(group_id: str) -> int | None:
    """``group_id`` is ``"{prompt_index}-{attempt}"`` (``proto.trajectory``)."""
    head = group_id.split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _collect_acks(records: RunRecords) -> _Acks:
    acks = _Acks()
    for rollout, events in records.rollout_events.items():
        for event in events:
            if event["event"] != "acked":
                continue
            for g in event.get("groups", []):
                gid, prompt, rows, status = g["group_id"], int(g["prompt_index"]), int(g["rows"]), g.get("status")
                if status == "accepted":
                    acks.accepted[gid].append((rollout, prompt, rows))
                elif status == "dropped_stale":
                    acks.stale_at_insert[gid] = (rollout, prompt, rows)
                elif status == "duplicate":
                    acks.duplicate_acks += 1
                    acks.duplicate_prompts.add(prompt)
                else:
                    acks.mixed[gid] = prompt
    return acks


def _replay_training(records: RunRecords, out: list[Violation]) -> _Training:
    """Walk the learner journal: keep valid commits, roll back the ones a resume discarded, and check
    each resume was from the newest valid commit (``resume_not_newest``)."""
    t = _Training()
    for event in records.learner_events:
        if event["event"] == "commit":
            t.valid.append(event)
        elif event["event"] == "resume":
            t.resumes += 1
            step = int(event["step"])
            newest = max((int(c["step"]) for c in t.valid), default=None)
            rejected = {int(r["step"]) for r in event.get("rejected", [])}
            if newest is not None and step < newest and newest not in rejected:
                out.append(Violation("resume_not_newest", (
                    f"resume #{t.resumes} (mode {event.get('mode', '?')}) loaded step {step} but checkpoint step "
                    f"{newest} was committed before it and is not among the rejected steps {sorted(rejected)}")))
            for c in [c for c in t.valid if int(c["step"]) > step]:
                t.valid.remove(c)
                why = f"trained in checkpoint step {c['step']}, rolled back by resume #{t.resumes} to step {step}"
                for gid in c.get("groups", []):
                    t.rolled_back[gid] = why
    return t


def _check_trained_twice(records: RunRecords, trained: Counter, steps: dict, out: list[Violation]) -> int:
    limit = records.replay_config.max_times_sampled
    over = sorted(g for g, n in trained.items() if n > limit)
    for gid in over:
        out.append(Violation("trained_twice", f"group {gid} trained {trained[gid]} times (checkpoint steps "
                                              f"{steps[gid]}); replay allows max_times_sampled={limit}"))
    return len(over)


def _excuse_budget(records: RunRecords, acks: _Acks) -> tuple[int, int]:
    """(stale rows, evicted groups) replay deleted after insert without naming them."""
    c = records.counters
    stale_rows = c.dead_timeline_deleted_total  # a crashed learner's timeline, deleted at the resumed one's Rejoin
    if records.replay_config.staleness_mode == "drop":  # dropped_stale_total holds those too
        stale_rows = max(0, c.dropped_stale_total - sum(rows for _, _, rows in acks.stale_at_insert.values()))
    return stale_rows, c.evicted_groups_total


def _check_lost(records: RunRecords, acks: _Acks, training: _Training, trained: Counter,
                out: list[Violation], counts: dict) -> None:
    stale_rows, evicted = _excuse_budget(records, acks)
    excused_stale = excused_evicted = lost = 0
    for gid, entries in acks.accepted.items():
        if gid in records.stored or trained[gid] > 0:
            continue
        rollout, prompt, rows = entries[0]
        if gid in training.rolled_back:
            reason = training.rolled_back[gid]
        elif stale_rows >= rows:
            stale_rows, excused_stale = stale_rows - rows, excused_stale + 1
            continue
        elif evicted > 0:
            evicted, excused_evicted = evicted - 1, excused_evicted + 1
            continue
        else:
            reason = "not trained by any committed checkpoint and not explained by replay's drop/evict counters"
        lost += 1
        out.append(Violation("lost", f"group {gid} (prompt {prompt}, acked to {rollout}) is not in replay: {reason}"))
    counts.update(lost_groups=lost, dropped_stale_groups=excused_stale, evicted_groups=excused_evicted)


def _check_prompts(records: RunRecords, acks: _Acks, trained: Counter, out: list[Violation]) -> None:
    completing: dict[int, list[str]] = defaultdict(list)
    for gid, entries in acks.accepted.items():
        for rollout, prompt, _ in entries:
            completing[prompt].append(f"{gid} accepted from {rollout}")
    for gid, (rollout, prompt, _) in acks.stale_at_insert.items():
        completing[prompt].append(f"{gid} dropped stale at insert from {rollout}")
    for prompt in sorted(p for p, groups in completing.items() if len(groups) > 1):
        out.append(Violation("prompt_not_once", f"prompt {prompt} completed {len(completing[prompt])} times: "
                                                + "; ".join(completing[prompt])))
    for gid, entries in acks.accepted.items():
        prompt = entries[0][1]
        if prompt not in records.ledger_completed:
            out.append(Violation("prompt_not_once", f"prompt {prompt}: group {gid} was acknowledged as accepted "
                                                    "but replay's prompt ledger does not count the prompt complete"))
    evidence = (set(completing) | acks.duplicate_prompts | set(acks.mixed.values())
                | {g.prompt_index for g in records.stored.values()}
                | {p for g in trained if (p := _prompt_of(g)) is not None})
    for prompt in sorted(records.ledger_completed - evidence):
        out.append(Violation("prompt_not_once", f"prompt {prompt} is complete in replay's ledger but no rollout "
                                                "journaled a group for it, replay holds none and none was trained"))


def _check_versions(records: RunRecords, out: list[Violation]) -> int:
    events = 0
    for rollout, journal in records.rollout_events.items():
        newest: dict[tuple[int, int], int] = {}
        for event in journal:
            if event["event"] != "weights":
                continue
            events += 1
            pid, version = int(event["pid"]), int(event["version"])
            key = (pid, int(event.get("timeline", 0)))  # journals before timelines: one timeline
            if key in newest and version < newest[key]:
                out.append(Violation("version_regressed", f"{rollout} pid {pid} applied policy version {version} "
                                                          f"after version {newest[key]} (timeline {key[1]})"))
            newest[key] = max(version, newest.get(key, version))
    return events


def check_records(records: RunRecords) -> InvariantReport:
    """Apply every rule (module doc) to loaded run records; see ``check_run``."""
    out: list[Violation] = []
    acks = _collect_acks(records)
    training = _replay_training(records, out)
    trained: Counter = Counter()
    steps: dict[str, list[int]] = defaultdict(list)
    for c in training.valid:
        for gid in c.get("groups", []):
            trained[gid] += 1
            steps[gid].append(int(c["step"]))
    counts = {"acknowledged_groups": len(acks.accepted), "trained_groups": len(trained),
              "in_replay_groups": len(records.stored), "prompts_completed": len(records.ledger_completed),
              "resumes": training.resumes, "commits": len(training.valid),
              "rolled_back_groups": len(training.rolled_back), "duplicate_acks": acks.duplicate_acks,
              "dropped_stale_at_insert_groups": len(acks.stale_at_insert), "mixed_ack_groups": len(acks.mixed),
              "trained_unacknowledged_groups": len(set(trained) - set(acks.accepted)),
              "replay_dropped_stale_rows": records.counters.dropped_stale_total,
              "replay_evicted_groups": records.counters.evicted_groups_total,
              "torn_journal_tails": len(records.torn_tails), "replay_shards": records.replay_config.shards}
    counts["duplicates_trained"] = _check_trained_twice(records, trained, steps, out)
    _check_lost(records, acks, training, trained, out, counts)
    _check_prompts(records, acks, trained, out)
    counts["rollout_version_events"] = _check_versions(records, out)
    return InvariantReport(out, counts)


def check_run(run_dir: str | Path) -> InvariantReport:
    """Check a finished run directory (``recipe.out_dir``, i.e. ``runs/<name>``); changes nothing in it.

    Raises:
        RunDirError: not a run directory, a journal is missing or has a corrupt line (named), or replay's
            directory does not restore.
    """
    return check_records(load_run(run_dir))
