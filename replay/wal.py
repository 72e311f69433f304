"""Write-ahead log writer: segments of Arrow IPC stream records, group-committed fsync.

Layout: ``{dir}/wal/{first_lsn:020d}.arrows``. Every record has a log sequence number (LSN); a
segment holds the records ``first_lsn, first_lsn + 1, ...`` in order, so LSNs are not stored. A writer
never appends to a segment it did not create: after a restart it starts a new segment at the next LSN.

Commit protocol (``durability="fsync"``): the caller appends a record's bytes with one ``writev()`` of
the pieces Arrow's IPC writer produced (``records.encode_parts``: an insert's payload is written from
the received buffer, never copied into a joined record)
(under the buffer's lock, so log order is apply order), releases its lock and calls ``wait(lsn)``,
which returns once every segment up to ``lsn`` is fsync'd (and the WAL directory, when a segment was
created). Group commit is leader/follower (as in PostgreSQL's and InnoDB's logs): a waiter whose
record is not durable and finds no fsync in flight becomes the leader and fsyncs everything appended
so far, optionally waiting ``group_commit_ms`` first; waiters arriving meanwhile wait for it and then
one of them leads the next fsync, which covers everything appended while the previous one ran. So
concurrent operations share one fsync, and no thread hand-off sits between a write and its ack.
A write or fsync error is not retried (after a failed fsync the page cache state is unknown — the
"fsyncgate" lesson of PostgreSQL): the log fails for good, calls ``on_fail`` once, and every later
``append``/``wait`` raises ``WalError`` naming the first error. The service reports NOT_SERVING and must
be restarted, which restores from what is on disk (every acknowledged record was fsync'd before).

Segments roll once they exceed ``segment_bytes``; the sealed segment is fsync'd by the next fsync
leader before any record of the new segment is reported durable (and closed after). ``durability="buffered"``
keeps a background thread that writes the queued records every ``group_commit_ms``.

With ``wal.drop_page_cache`` (the default) the log leaves the OS page cache once fsync'd: after each
group-commit fsync the leader drops the durable pages (``replay.files.drop_cached``), after telling the
waiters, and ``close()`` drops the last segment. Only a restore reads the log again. The other modes
never fsync before ``close()``, and dropping dirty pages would only start their writeback on the
appending thread, so their log stays cached until the kernel writes it back and reclaims it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from gyre.replay.config import WalConfig
from gyre.faults import fault_point
from gyre.replay.files import drop_cached, fsync_dir, remove_gently
from gyre.replay.records import end_of_stream, segment_header

SEGMENT_SUFFIX = ".arrows"
_IOV_MAX = 1024
"""Most pieces one ``writev`` takes (Linux ``IOV_MAX``)."""


class WalError(OSError):
    """The log cannot accept or persist records (disk error, closed); the message names the file."""


def segment_path(wal_dir: Path, first_lsn: int) -> Path:
    return wal_dir / f"{first_lsn:020d}{SEGMENT_SUFFIX}"


class Wal:
    """Appends encoded records to the current segment and makes them durable.

    Args:
        wal_dir: the segment directory (created if missing).
        config: durability mode, group-commit window and segment size.
        next_lsn: LSN of the first record this writer appends.
        on_fail: called once, with the exception, when the log fails (from the thread that saw it,
            holding the log's lock: it must not call back into the log).
        gate: marks each group-commit fsync ``urgent`` so a snapshot's writeback waits for it
            (``replay.files.ForegroundGate``); ``None``: no coordination.
    """

    def __init__(self, wal_dir: Path, config: WalConfig, next_lsn: int, on_fail=None, gate=None) -> None:
        self.dir, self.config, self.gate = Path(wal_dir), config, gate
        self.dir.mkdir(parents=True, exist_ok=True)
        self._cv = threading.Condition()
        self._next_lsn = next_lsn
        self._durable_lsn = next_lsn - 1
        self._sealed: list[tuple[int, Path]] = []
        self._pending: list = []  # "buffered" mode only
        self._error: BaseException | None = None
        self._on_fail = on_fail
        self._closed = False
        self._syncing = False  # a leader's fsync is in flight ("fsync" mode)
        self.bytes_written = 0
        """Bytes appended by this writer (all segments)."""
        self.fsyncs = 0
        """fsync calls on segments (group commit shares one among many records)."""
        self._open_segment()
        self._thread = None
        if config.durability == "buffered":
            self._thread = threading.Thread(target=self._sync_loop, name="wal-sync", daemon=True)
            self._thread.start()

    @property
    def next_lsn(self) -> int:
        """LSN the next appended record gets."""
        return self._next_lsn

    def _open_segment(self) -> None:
        self.path = segment_path(self.dir, self._next_lsn)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._write(segment_header())
        self._segment_bytes = 0
        self._dir_dirty = True
        if self.config.durability != "fsync":
            fsync_dir(self.dir)

    def _write(self, data) -> None:
        """Write bytes-like ``data``, or a list of bytes-like pieces with one ``writev`` (no join)."""
        if isinstance(data, list):
            views = [memoryview(p).cast("B") for p in data]
            while views:
                written = os.writev(self._fd, views[:_IOV_MAX])
                while views and written >= views[0].nbytes:
                    written -= views.pop(0).nbytes
                if views and written:
                    views[0] = views[0][written:]
            return
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def append(self, records: list) -> int:
        """Append encoded records, each bytes-like or a list of bytes-like pieces (``records.encode_parts``),
        with one write; returns the LSN of the last one.

        Raises:
            WalError: the log failed earlier or is closed.
        """
        with self._cv:
            self._check()
            data = [p for r in records for p in (r if isinstance(r, list) else [r])]
            try:
                if self.config.durability == "buffered":
                    self._pending.append(data)
                else:
                    fault_point("replay.wal.before_write")
                    self._write(data)
            except OSError as exc:  # a partial record may be on disk: nothing may follow it
                self._fail(exc)
                raise WalError(f"WAL append to {self.path} failed: {exc}") from exc
            self._next_lsn += len(records)
            nbytes = sum(memoryview(p).nbytes for p in data)
            self._segment_bytes += nbytes
            self.bytes_written += nbytes
            fault_point("replay.wal.after_append")
            if self._segment_bytes >= self.config.segment_bytes:
                try:
                    self._roll()
                except OSError as exc:
                    self._fail(exc)
                    raise WalError(f"WAL could not start a segment after {self.path}: {exc}") from exc
            if self._thread is not None:  # "buffered": the writer thread waits for queued records;
                self._cv.notify_all()     # fsync waiters wait for a leader, never for an append
            return self._next_lsn - 1

    def _roll(self) -> None:
        self._flush_pending()
        self._write(end_of_stream())
        if self.config.durability == "fsync":
            self._sealed.append((self._fd, self.path))
        else:
            os.close(self._fd)
        self._open_segment()
        fault_point("replay.wal.after_roll")

    def _flush_pending(self) -> None:
        if self._pending:
            data, self._pending = [p for d in self._pending for p in d], []
            self._write(data)

    def wait(self, lsn: int) -> None:
        """Block until the record ``lsn`` is durable under the configured mode; in ``fsync`` mode the
        calling thread may run the fsync itself (group commit leader, see the module doc).

        Raises:
            WalError: the log failed (now or earlier) or is closed.
            ValueError: ``lsn`` was never appended.
        """
        if self.config.durability != "fsync":
            self._check()
            return
        while True:
            with self._cv:
                while self._durable_lsn < lsn and self._syncing:
                    self._check()
                    self._cv.wait(timeout=1.0)
                if self._durable_lsn >= lsn:
                    return
                self._check()
                if lsn >= self._next_lsn:
                    raise ValueError(f"WAL record {lsn} was never appended (next LSN is {self._next_lsn})")
                self._syncing = True
            self._lead()

    def _lead(self) -> None:
        """One group-commit fsync by the calling thread (``_syncing`` is set); fails the log on error."""
        try:
            if self.config.group_commit_ms:
                time.sleep(self.config.group_commit_ms / 1000.0)
            self._sync_once()
        except OSError as exc:
            with self._cv:
                self._fail(exc)
            raise WalError(f"WAL {self.dir} failed: {exc}") from exc
        finally:
            with self._cv:
                self._syncing = False
                self._cv.notify_all()

    def _fail(self, exc: BaseException) -> None:
        """Mark the log failed (caller holds ``_cv``) and tell ``on_fail`` the first time."""
        first = self._error is None
        if first:
            self._error = exc
        self._cv.notify_all()
        if first and self._on_fail is not None:
            self._on_fail(exc)

    @property
    def error(self) -> BaseException | None:
        """The error that failed the log, or ``None`` while it works."""
        return self._error

    def _check(self) -> None:
        if self._error is not None:
            raise WalError(f"WAL {self.dir} failed: {self._error}") from self._error
        if self._closed:
            raise WalError(f"WAL {self.dir} is closed")

    def _sync_loop(self) -> None:
        window = self.config.group_commit_ms / 1000.0
        while True:
            with self._cv:
                while not self._closed and not self._pending:
                    self._cv.wait(timeout=window or 0.005)
                if self._closed:
                    return
            if window:
                time.sleep(window)
            try:
                self._sync_once()
            except OSError as exc:
                with self._cv:
                    self._fail(exc)
                return

    def _sync_once(self) -> None:
        with self._cv:
            target, sealed, self._sealed = self._next_lsn - 1, self._sealed, []
            fd, dir_dirty, self._dir_dirty = self._fd, self._dir_dirty, False
            end = len(segment_header()) + self._segment_bytes  # the file's bytes (fsync mode writes at once)
            if self.config.durability == "buffered":
                self._flush_pending()
                self._durable_lsn = target
                return
        fault_point("replay.wal.before_fsync")
        with self.gate.urgent() if self.gate is not None else contextlib.nullcontext():
            for old_fd, _ in sealed:
                os.fsync(old_fd)
            os.fsync(fd)  # the current fd is only closed by close(), which waits for the leader first
            if dir_dirty:
                fsync_dir(self.dir)
        with self._cv:
            self.fsyncs += 1 + len(sealed)
            self._durable_lsn = max(self._durable_lsn, target)
            self._cv.notify_all()
        for old_fd, _ in sealed:  # after the waiters are told: dropping pages is no part of an ack
            self._drop(old_fd)
            os.close(old_fd)
        self._drop(fd, end)

    def _drop(self, fd: int, end: int = 0) -> None:
        """With ``drop_page_cache``, drop ``fd``'s first ``end`` bytes (0: all), fsync'd, from the page
        cache (``replay.files.drop_cached``: the page still being appended to is kept)."""
        if self.config.drop_page_cache:
            drop_cached(fd, 0, end)

    def close(self) -> None:
        """Write what is pending, end the segment, fsync and close (after a leader's fsync in flight
        ends; later waiters get ``WalError``). Idempotent."""
        with self._cv:
            if self._closed:
                return
            while self._syncing:
                self._cv.wait(timeout=1.0)
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._cv:
            if self._error is None:
                self._flush_pending()
                self._write(end_of_stream())
                for old_fd, _ in self._sealed:
                    os.fsync(old_fd)
                    self._drop(old_fd)
                    os.close(old_fd)
                os.fsync(self._fd)
                self._drop(self._fd)
                fsync_dir(self.dir)
                self._durable_lsn = self._next_lsn - 1
            os.close(self._fd)

    def segments(self) -> list[Path]:
        """All segment files in the directory, oldest first."""
        return sorted(self.dir.glob(f"*{SEGMENT_SUFFIX}"))

    def delete_covered(self, lsn: int) -> list[Path]:
        """Delete sealed segments whose records are all below ``lsn``; returns the deleted paths."""
        with self._cv:
            files = [p for p in self.segments() if p != self.path]
            current_first = int(self.path.stem)
            open_sealed = {p for _, p in self._sealed}
        deleted = []
        firsts = [int(p.stem) for p in files] + [current_first]
        for path, next_first in zip(files, firsts[1:]):
            if next_first <= lsn and path not in open_sealed:
                remove_gently(path, self.gate)  # covered: a shorter file after a crash is never read
                deleted.append(path)
        if deleted:
            fsync_dir(self.dir)
        return deleted
