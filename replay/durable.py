"""Durability of one buffer directory: restore at start, WAL while running, snapshots in the background.

Directory layout (``config.dir``)::

    wal/{first_lsn:020d}.arrows      WAL segments (replay.wal)
    snapshots/snap-{lsn:020d}/        committed snapshots, newest ``snapshot.keep`` kept (replay.snapshot)
    quarantine/                       corrupt snapshots/segments set aside by restore, never read again

Snapshots never stop inserts and samples for their whole duration (Reverb blocks every operation
while it checkpoints): under the buffer's lock a snapshot only copies the group dict (pointers to
immutable Arrow tables and frozen records), the small state and the WAL position; compaction,
compression, hashing and fsync happen outside the lock while the buffer keeps serving. Before the
snapshot is committed, the WAL is made durable up to its position, so a snapshot never contains
anything the log could lose. After the commit, old snapshots beyond ``keep`` are removed and WAL
segments covered by the oldest kept snapshot are deleted. The files are written by a low-priority
thread through Arrow's native writer (the GIL is released while it encodes and writes), so the
snapshot competes as little as possible with the insert and sample threads; its writeback goes in
1 MiB ranges, and each of its steps (a record batch, a range hashed or written back, a chunk of an old
file deleted) first lets the foreground work in flight finish — WAL fsyncs and inserts
(``replay.files.ForegroundGate``) — and, while inserts keep arriving, pauses ``snapshot.busy_pause_ms``,
so inserts neither queue behind the snapshot on the disk nor share the cores and the GIL with it for
long (an idle server's snapshot runs at full speed).

Garbage collection: restore runs with the cycle collector paused and then ``gc.freeze()``s what it
built; every snapshot freezes the survivors again. Full collections therefore never walk the whole
store (a 1M-object walk stalls every thread for 100s of ms).

With ``wal.keep_segments`` no WAL segment is ever deleted: the directory is then a recording, the run's
whole history, that other runs can train from (``replay.recorded``).

WAL failure (disk full, I/O error): the log fails for good (``replay.wal``), ``failure`` says why,
and listeners (the gRPC server's health status) are told once; every later change raises ``WalError``.
"""

from __future__ import annotations

import gc
import hashlib
import threading
import time
from pathlib import Path

import structlog

from gyre.faults import fault_point
from gyre.replay.files import ForegroundGate, run_in_background
from gyre.replay.restore import RestoreError, RestoreReport, restore
from gyre.replay.snapshot import list_snapshots, remove_snapshot, write_snapshot
from gyre.replay.wal import Wal

log = structlog.get_logger("replay")

__all__ = ["Durability", "RestoreError"]


def _restore_frozen(state, root: Path) -> RestoreReport:
    """``restore`` with the cycle collector paused (it would rescan the growing store again and again),
    then ``gc.freeze()``: the restored groups move to the permanent generation, so later full
    collections do not walk them (no GC pauses proportional to the restored size on the insert path)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        report = restore(state, root)
    finally:
        if was_enabled:
            gc.enable()
    gc.freeze()
    return report


def _freeze_survivors() -> None:
    """After a snapshot: collect the young generations (cheap), then move every survivor (mostly
    stored groups) to the permanent generation, so full collections stay proportional to what changed
    since the last snapshot instead of to the store (a full scan of 1M objects pauses every thread for
    ~100s of ms). Objects frozen here are still freed by reference counting when deleted; only a
    reference cycle among them would be left to the next restart."""
    gc.collect(1)
    gc.freeze()


class Durability:
    """Owns the WAL and the snapshots of ``buffer.config.dir``; started by ``TrajectoryBuffer``.

    Raises:
        RestoreError: the directory holds data but nothing valid loads.
    """

    def __init__(self, buffer) -> None:
        self.buffer, self.config = buffer, buffer.config
        self.root = Path(self.config.dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.report: RestoreReport = _restore_frozen(buffer.state, self.root)
        self._listeners: list = []
        self.foreground = ForegroundGate(pause_s=self.config.snapshot.busy_pause_ms / 1000.0)
        """Foreground first: snapshot steps wait for the WAL fsyncs and inserts in flight (``replay.files``)."""
        self.wal = Wal(self.root / "wal", self.config.wal, self.report.next_lsn, on_fail=self._wal_failed,
                       gate=self.foreground)
        self._snap_lock = threading.Lock()
        self._config_hash = hashlib.sha256(self.config.model_dump_json().encode()).hexdigest()
        self._last_lsn = self.report.snapshot_lsn if self.report.snapshot else (0 if self.report.next_lsn == 0 else -1)
        self._last_at = self.report.snapshot_created_at
        self._bytes_at_last = 0
        self._started_at = time.time()
        self.snapshots_written = 0
        self.last_snapshot_seconds = 0.0
        """Seconds the newest snapshot took from capture to commit (without pruning old ones)."""
        self._stop = threading.Event()
        self._thread = None

    def _wal_failed(self, exc: BaseException) -> None:
        log.error("replay_wal_failed", dir=str(self.root), error=str(exc),
                  action="every change now fails with WalError; restart the service to restore")
        for listener in list(self._listeners):
            listener(self.failure)

    @property
    def failure(self) -> str | None:
        """Why the WAL failed (``"WAL {dir} failed: [Errno 28] No space left on device"``), or ``None``
        while it works. A failed WAL stays failed until the service restarts (see ``replay.wal``)."""
        error = self.wal.error
        return None if error is None else f"WAL {self.wal.dir} failed: {error}"

    def add_failure_listener(self, listener) -> None:
        """Call ``listener(failure message)`` once when the WAL fails (at once if it already has);
        it runs on the thread that hit the error and must not block or call into the buffer."""
        self._listeners.append(listener)
        if self.failure is not None:
            listener(self.failure)

    def start(self) -> None:
        """Start periodic snapshots (once the buffer logs to ``self.wal``)."""
        snap = self.config.snapshot
        if self._thread is None and (snap.interval_s is not None or snap.wal_bytes is not None):
            self._thread = threading.Thread(target=self._loop, name="replay-snapshot", daemon=True)
            self._thread.start()

    def snapshot(self) -> Path | None:
        """Write a snapshot now (if anything changed since the last one); returns its path or ``None``."""
        with self._snap_lock:
            if self.wal.next_lsn == self._last_lsn:
                return None
            data = self.buffer.capture()
            if data.lsn == self._last_lsn:
                return None
            t0 = time.monotonic()
            self.wal.wait(data.lsn - 1)
            root = self.root / "snapshots"
            path = run_in_background(write_snapshot, root, data, self.config.snapshot.compression, self._config_hash,
                                     self.foreground, self.config.snapshot.drop_page_cache)
            self.last_snapshot_seconds = time.monotonic() - t0
            for old in list_snapshots(root)[self.config.snapshot.keep:]:
                remove_snapshot(old, self.foreground)
            fault_point("replay.snapshot.before_wal_delete")
            kept = list_snapshots(root)
            keep_all = self.config.wal.keep_segments  # a recording keeps its whole history (replay.recorded)
            deleted = self.wal.delete_covered(int(kept[-1].name[5:])) if kept and not keep_all else []
            self._last_lsn, self._last_at = data.lsn, time.time()
            self._bytes_at_last = self.wal.bytes_written
            self.snapshots_written += 1
            _freeze_survivors()
            log.info("replay_snapshot", path=str(path), lsn=data.lsn, groups=len(data.groups),
                     seconds=round(time.monotonic() - t0, 3), wal_segments_deleted=len(deleted))
            return path

    def _due(self) -> bool:
        snap = self.config.snapshot
        if snap.wal_bytes is not None and self.wal.bytes_written - self._bytes_at_last >= snap.wal_bytes:
            return True
        if snap.interval_s is None:
            return False
        return time.time() - (self._last_at or self._started_at) >= snap.interval_s

    def _loop(self) -> None:
        tick = min(0.5, (self.config.snapshot.interval_s or 1.0) / 4)
        while not self._stop.wait(tick):
            if self._due():
                try:
                    self.snapshot()
                except OSError as exc:  # keep serving from the WAL; the next tick retries
                    log.error("replay_snapshot_failed", error=str(exc))

    def info(self) -> dict:
        """WAL and snapshot figures for Info/metrics."""
        return {
            "wal_bytes": self.wal.bytes_written, "wal_fsyncs": self.wal.fsyncs,
            "wal_segments": len(self.wal.segments()), "wal_next_lsn": self.wal.next_lsn,
            "snapshots_written": self.snapshots_written, "last_snapshot_seconds": self.last_snapshot_seconds,
            "last_snapshot_age_s": -1.0 if self._last_at is None else time.time() - self._last_at,
            "restore_seconds": self.report.seconds, "restore_records_replayed": self.report.records_replayed,
            "restore_errors": len(self.report.errors),
        }

    def close(self) -> None:
        """Stop the snapshot thread and close the WAL; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._snap_lock:
            self.wal.close()
