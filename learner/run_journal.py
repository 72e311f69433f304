"""The learner's run journal (``proto.journal`` format): which groups each committed checkpoint trained
on, and where every (re)start resumed from — what ``gyre check`` (``services.cli.invariants``) verifies.

Events (one JSON line each, fsync'd before the learner goes on):

- ``save_begin`` {step, policy_version, groups}: a checkpoint save of ``step`` starts; ``groups`` are the
  ``group_id``s of the leased batches it covers. Written before the save, so a crash between the commit
  and the ``commit`` event still leaves the group ids on disk (also in ``CheckpointMetadata.pending_group_ids``).
- ``commit`` {step, policy_version, groups}: that checkpoint committed; written before its leases are
  acked to replay (``LearnerLoop._on_committed``).
- ``resume`` {step, policy_version, path, mode, newest_committed_seen, rejected: [{step, path, error}]}:
  written on every start (cold start: step 0, path null). With ``mode`` auto, ``rejected`` names every
  checkpoint on disk (primary or mirror) newer than the one resumed and why it did not verify (each is
  verified once more here: only bad checkpoints are newer, so a healthy restart hashes nothing extra);
  with ``none`` or an explicit path nothing newer was considered and ``rejected`` is empty. Before it, a ``commit`` event
  the journal lacks for the resumed checkpoint is re-appended (a crash between commit and journal append).
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import structlog

from gyre.learner.checkpoint import store as ckpt
from gyre.proto.journal import Journal, JournalError, read_journal

log = structlog.get_logger("learner.journal")


def group_ids_of(table: pa.Table) -> list[str]:
    """Distinct ``group_id`` values of a leased batch ``[rows]``, in first-appearance order."""
    return pc.unique(table.column("group_id")).to_pylist()


def _step_of(path: Path) -> int:
    return int(Path(path).name.rsplit("_", 1)[1])


class LearnerJournal:
    """Writes the learner's journal at ``path`` (``{run}/learner_journal.jsonl`` under the controller).

    Raises:
        OSError: the journal cannot be created or opened.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.journal = Journal(self.path)
        self._saving: dict[int, int] = {}
        """step → policy version of saves begun and not yet journaled as committed."""

    def save_begin(self, step: int, policy_version: int, groups: list[str]) -> None:
        """A checkpoint save of ``step`` covering ``groups`` starts."""
        self._saving[step] = policy_version
        self.journal.append({"event": "save_begin", "step": step, "policy_version": policy_version,
                             "groups": list(groups), "time": time.time()})

    def commit(self, path: Path, groups: list[str]) -> None:
        """The checkpoint at ``path`` (``global_step_N``) committed; its leases are about to be acked."""
        step = _step_of(path)
        version = self._saving.pop(step, step)
        self.journal.append({"event": "commit", "step": step, "policy_version": version,
                             "groups": list(groups), "time": time.time()})

    def resume(self, path: Path | None, meta, mode: str, roots: list[Path]) -> None:
        """Journal a (re)start: re-append the resumed checkpoint's ``commit`` event if missing, then the
        ``resume`` event. ``meta`` is the loaded ``CheckpointMetadata`` (``None`` on a cold start);
        ``roots`` are the checkpoint directories searched (primary, then mirror)."""
        step = meta.step if meta is not None else 0
        version = meta.policy_version if meta is not None else 0
        if meta is not None:
            self._reappend_commit(meta)
        on_disk = [p for root in roots for p in ckpt.list_checkpoints(root)]
        rejected = []
        for candidate in on_disk if mode == "auto" else []:  # other modes did not consider newer ones
            if _step_of(candidate) > step:
                try:
                    ckpt.verify(candidate)
                except ckpt.CheckpointError as exc:
                    rejected.append({"step": _step_of(candidate), "path": str(candidate), "error": str(exc)})
        newest = max((_step_of(p) for p in on_disk), default=None)
        self.journal.append({"event": "resume", "step": step, "policy_version": version,
                             "path": str(path) if path is not None else None, "mode": str(mode),
                             "newest_committed_seen": newest, "rejected": rejected, "time": time.time()})

    def _reappend_commit(self, meta) -> None:
        """Append the ``commit`` event of the checkpoint at ``meta.step`` unless the journal already has
        it after the last ``save_begin`` of that step. Group ids come from the metadata, else from that
        ``save_begin`` event."""
        try:
            events = read_journal(self.path).events
        except JournalError as exc:  # recovery path: `gyre check` reports the corrupt line itself
            log.error("learner_journal_unreadable", path=str(self.path), error=str(exc))
            events = []
        last_begin, committed = None, False
        for event in events:
            if event.get("step") != meta.step:
                continue
            if event["event"] == "save_begin":
                last_begin, committed = event, False
            elif event["event"] == "commit":
                committed = True
        if committed:
            return
        groups = list(meta.pending_group_ids or (last_begin or {}).get("groups", []))
        log.warning("learner_journal_commit_reappended", step=meta.step, groups=len(groups),
                    source="metadata" if meta.pending_group_ids else "save_begin")
        self.journal.append({"event": "commit", "step": meta.step, "policy_version": meta.policy_version,
                             "groups": groups, "reappended": True, "time": time.time()})
