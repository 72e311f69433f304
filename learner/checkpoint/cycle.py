"""The learner's checkpoint cycle: commit the trained state, then acknowledge the leases it trained on.

Acking only after the commit (docs/concepts/architecture.md) means a learner crash loses no trajectory: leases not
yet acked expire in replay (``ReplayConfig.lease_ttl_s``) and their groups are sampled again. A committed
checkpoint is journaled (``learner.run_journal``), mirrored before its leases are acked (``mirror_dir``) and queued
for the archive after (``archive``); an asynchronous save (``async_save``) commits in the background and its leases
are acked when ``poll`` sees the commit. ``LearnerLoop`` decides *when* to save; this class is *how*.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path

import structlog

from gyre.learner.checkpoint.archive_uploads import ArchiveUploads
from gyre.learner.checkpoint.async_save import BackgroundSaver
from gyre.learner.checkpoint.request import CheckpointRequest
from gyre.learner.loop_config import LearnerLoopConfig
from gyre.learner.run_journal import LearnerJournal

log = structlog.get_logger("learner")


class CheckpointCycle:
    """Commits ``global_step_N`` checkpoints of ``engine`` into ``checkpoint_dir`` and acks their leases on ``replay``.

    Args:
        engine: has ``step``, ``version`` and ``save_checkpoint(CheckpointRequest) -> Path | Future[Path]``
            (``learner.engine.LearnerEngine``, ``learner.ranks.LeaderEngine`` or a test double).
        replay: has ``ack(lease_ids) -> int``.
        checkpoint_dir: ``None`` keeps every lease pending (nothing is acked) until a directory is given.
        journal: the run journal (``save_begin`` and ``commit`` events), or ``None``.
    """

    def __init__(self, config: LearnerLoopConfig, engine, replay, checkpoint_dir: Path | None,
                 journal: LearnerJournal | None) -> None:
        self.config, self.engine, self.replay, self.journal = config, engine, replay, journal
        self.checkpoint_dir = checkpoint_dir
        self.pending_lease_ids: list[str] = []
        """Leases trained on since the last committed checkpoint (not acked yet)."""
        self.acked_lease_count = 0
        self.last_checkpoint: Path | None = None
        self.archive = ArchiveUploads(config.archive)
        self._lease_groups: dict[str, list[str]] = {}
        """lease id → group ids of its batch, until the checkpoint holding it commits (journal, metadata)."""
        self._saver = BackgroundSaver() if config.async_save else None
        self._inflight: tuple[Future, list[str], str, float] | None = None  # (future, leases, name, started)
        self._mirror_failures = 0

    @property
    def checkpoint_dir(self) -> Path | None:
        return self._checkpoint_dir

    @checkpoint_dir.setter
    def checkpoint_dir(self, value: str | Path | None) -> None:
        self._checkpoint_dir = Path(value) if value is not None else None

    def trained(self, lease_id: str, group_ids: list[str]) -> None:
        """A step trained on lease ``lease_id`` (groups ``group_ids``): the next committed checkpoint acks it."""
        self.pending_lease_ids.append(lease_id)
        self._lease_groups[lease_id] = group_ids

    def save(self, spike_state: dict, wait: bool = True) -> float:
        """Checkpoint the engine's current step (unless it exists or is being written already) and ack every
        pending lease once it commits; returns the seconds the caller was blocked.

        With ``config.async_save`` and ``wait=False`` the commit happens in the background: ``poll`` acks the
        leases it covers after it commits (or returns them to the pending list if it fails, so the next checkpoint
        covers them). Raises ``RuntimeError`` without a ``checkpoint_dir``, and what the save raised when ``wait``.
        """
        if self.checkpoint_dir is None:
            raise RuntimeError("LearnerLoop has no checkpoint_dir; cannot checkpoint or ack")
        t0 = time.perf_counter()
        name = f"global_step_{self.engine.step}"
        inflight_here = self._inflight is not None and self._inflight[2] == name
        if not inflight_here and (self.last_checkpoint is None or self.last_checkpoint.name != name):
            self._finish(wait=True)
            leases, self.pending_lease_ids = self.pending_lease_ids, []
            groups = [g for lease in leases for g in self._lease_groups.get(lease, [])]
            if self.journal is not None:
                self.journal.save_begin(self.engine.step, self.engine.version, groups)
            result = self.engine.save_checkpoint(CheckpointRequest(
                self.checkpoint_dir, pending_lease_ids=leases, pending_group_ids=groups,
                acked_lease_count=self.acked_lease_count, fingerprint=self.config.fingerprint,
                spike_save=spike_state, keep_last_n=self.config.keep_last_n, saver=self._saver,
                protected=self.archive.pending, after_commit=self._mirror if self.config.mirror_dir is not None else None))
            if isinstance(result, Future):
                self._inflight = (result, leases, name, time.monotonic())
            else:
                self.last_checkpoint = result
                self._on_committed(leases)
        if wait:
            self._finish(wait=True, raise_errors=True)
        return time.perf_counter() - t0

    def poll(self) -> dict:
        """Ack the leases of a background save that has committed; returns its metrics
        (``checkpoint_write_s``: capture-to-commit seconds; ``checkpoint_failed``) or ``{}``."""
        return self._finish(wait=False)

    def _finish(self, wait: bool, raise_errors: bool = False) -> dict:
        if self._inflight is None:
            return {}
        future, leases, name, started = self._inflight
        if not wait and not future.done():
            return {}
        self._inflight = None
        try:
            self.last_checkpoint = future.result()
        except Exception as exc:  # the write failed: the leases stay pending for the next checkpoint
            self.pending_lease_ids = leases + self.pending_lease_ids
            log.error("checkpoint_failed", checkpoint=name, error=f"{type(exc).__name__}: {exc}")
            if raise_errors:
                raise
            return {"checkpoint_failed": 1.0}
        self._on_committed(leases)
        return {"checkpoint_write_s": time.monotonic() - started}

    def _on_committed(self, leases: list[str]) -> None:
        """A checkpoint holding ``leases`` committed: journal it, ack them, then queue its archive upload."""
        groups = [g for lease in leases for g in self._lease_groups.pop(lease, [])]
        if self.journal is not None and self.last_checkpoint is not None:
            self.journal.commit(self.last_checkpoint, groups)
        if leases:
            self.replay.ack(leases)
            self.acked_lease_count += len(leases)
        if self.config.archive is not None and self.last_checkpoint is not None:
            self.archive.submit(self.last_checkpoint)

    def _mirror(self, path: Path) -> None:
        """Copy a just-committed checkpoint to ``mirror_dir`` (runs before its leases are acked). A failure
        is logged, not raised: the primary copy is committed, so the leases may still be acked."""
        from gyre.learner.checkpoint.mirror import mirror_checkpoint

        try:
            mirror_checkpoint(path, Path(self.config.mirror_dir), self.config.keep_last_n)
        except Exception as exc:  # recovery path: the mirror disk failing must not stop training
            self._mirror_failures += 1
            log.error("checkpoint_mirror_failed", path=str(path), error=f"{type(exc).__name__}: {exc}")

    def wait_for_uploads(self, timeout_s: float | None = None) -> None:
        """Block until every queued archive upload finished (end of run, tests)."""
        self.archive.wait(timeout_s)

    @property
    def tier_failures(self) -> int:
        """Mirror copies and archive uploads that failed (logged; training went on)."""
        return self._mirror_failures + self.archive.failures

    def restored(self, path: Path, acked_lease_count: int) -> None:
        """The engine was loaded from checkpoint ``path``, which had acked ``acked_lease_count`` leases."""
        self.last_checkpoint = path
        self.acked_lease_count = acked_lease_count
