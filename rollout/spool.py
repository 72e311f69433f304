"""Durable local spool: a rollout's trajectories that replay has not acknowledged yet.

A generated group is durable in the spool *before* the worker counts it as done; a flusher then
delivers the spool to replay in put order and deletes each entry only after replay acknowledged it.
A replay outage therefore loses nothing and blocks nothing until the spool is full (the worker then
leases no new prompt). Re-sending is harmless: replay's prompt ledger completes each prompt index
exactly once and counts a later group of a completed prompt as duplicates (``replay.ledger``).

On-disk layout (one directory per rollout service)::

    {seq:012d}-{crc32:08x}.arrow   one group, Arrow IPC *stream* bytes (the wire payload of ``to_ipc``)
    .tmp-{seq:012d}.arrow          a put in progress (removed by ``recover``)
    quarantine/                    files that failed verification, moved aside, never loaded

Integrity: Arrow IPC carries no checksum, so the CRC-32 (``zlib.crc32``) of the file's bytes is part
of its name. A put writes the temp file, fsyncs it, renames it to its final name and fsyncs the
directory, so a name is visible only for complete bytes; loading re-reads the bytes, compares the
CRC and validates the table (``proto.trajectory_upgrade.read_ipc``: a spool written by the previous schema version is upgraded). A truncated file, a flipped byte or a
wrong schema version raises ``SpoolCorruptError`` naming the file and the reason; ``recover`` and the
flusher move such a file to ``quarantine/`` and log ``spool_quarantined`` — it is never sent.

Fault points (crash tests arm one with ``GYRE_FAULT_POINT=name[#n]``; the process SIGKILLs itself, see ``faults``):
``rollout.spool.before_rename`` (temp file written and fsynced), ``rollout.spool.after_rename`` (entry
durable, worker not told yet), ``rollout.spool.flush`` (replay acknowledged an entry, spool not acked).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import pyarrow as pa
import structlog

from gyre.faults import fault_point
from gyre.utils.durable import fsync_path as _fsync_dir
from gyre.proto.trajectory import SchemaError, to_ipc
from gyre.proto.trajectory_upgrade import read_ipc

log = structlog.get_logger("rollout.spool")

_ENTRY = re.compile(r"^(\d{12})-([0-9a-f]{8})\.arrow$")
_TMP_PREFIX = ".tmp-"
_SEQ = re.compile(r"^(?:\.tmp-)?(\d{12})[-.]")
QUARANTINE = "quarantine"

REFUSED_CODES = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "OUT_OF_RANGE"})
"""gRPC status names after which replay will refuse the same bytes again: the entry is quarantined."""



class SpoolCorruptError(ValueError):
    """A spool file failed verification (truncated, bytes changed, unreadable, bad schema); the
    message names the file and the reason."""


@dataclass(frozen=True)
class SpoolEntry:
    """One spooled group: a file that replay has not acknowledged yet."""

    seq: int
    """Put order, unique within the directory (smaller is older)."""
    path: Path
    """The entry's file, ``{seq:012d}-{crc32:08x}.arrow``."""
    nbytes: int
    """File size in bytes (Arrow IPC stream)."""
    crc32: int
    """``zlib.crc32`` of the file's bytes, as written in its name."""
    created_at: float
    """Unix seconds of the put (the file's mtime after ``recover``)."""


@dataclass(frozen=True)
class SpoolStats:
    """Gauges of the spool, for metrics."""

    pending_groups: int
    """Entries not yet acknowledged by replay."""
    pending_bytes: int
    """Their total file size in bytes."""
    oldest_age_s: float
    """Seconds since the oldest pending entry was put (0 when empty)."""
    quarantined: int
    """Files moved to ``quarantine/`` by this process."""

    def as_dict(self) -> dict:
        return {"spool_pending_groups": self.pending_groups, "spool_pending_bytes": self.pending_bytes,
                "spool_oldest_age_s": self.oldest_age_s, "spool_quarantined": self.quarantined}


class Spool:
    """Arrow IPC files of groups not yet acknowledged by replay, one file per group (thread-safe).

    Args:
        dir: spool directory (created if missing); one per rollout service.
        max_bytes: backpressure limit on pending bytes (``full()``); a put itself never refuses.
        max_groups: backpressure limit on pending groups (``full()``).
        clock: unix seconds, for ``created_at`` and ``oldest_age_s``.

    Raises:
        ValueError: ``max_bytes`` or ``max_groups`` is below 1.
    """

    def __init__(self, dir: str | Path, max_bytes: int, max_groups: int, clock=time.time) -> None:
        if max_bytes < 1:
            raise ValueError(f"spool max_bytes ({max_bytes}) must be >= 1")
        if max_groups < 1:
            raise ValueError(f"spool max_groups ({max_groups}) must be >= 1")
        self.dir, self.max_bytes, self.max_groups, self._clock = Path(dir), max_bytes, max_groups, clock
        self.quarantine_dir = self.dir / QUARANTINE
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._entries: dict[int, SpoolEntry] = {}
        self._quarantined = 0
        seqs = [int(m.group(1)) for p in self.dir.iterdir() if (m := _SEQ.match(p.name))]  # temp files too
        self._next_seq = max(seqs, default=-1) + 1

    # ---- write / acknowledge ----------------------------------------------------------------------
    def put(self, table: pa.Table) -> SpoolEntry:
        """Write one group's table durably (temp file → fsync → rename → fsync dir) and return its entry.

        Args:
            table: the group's rows, ``TRAJECTORY_SCHEMA`` (``[n]`` rows).

        Raises:
            OSError: the disk refused the write (nothing is registered; the temp file may remain).
        """
        payload = to_ipc(table)
        crc = zlib.crc32(payload)
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
        tmp = self.dir / f"{_TMP_PREFIX}{seq:012d}.arrow"
        with open(tmp, "xb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        fault_point("rollout.spool.before_rename")
        path = self.dir / f"{seq:012d}-{crc:08x}.arrow"
        os.rename(tmp, path)
        _fsync_dir(self.dir)
        fault_point("rollout.spool.after_rename")
        entry = SpoolEntry(seq, path, len(payload), crc, self._clock())
        with self._lock:
            self._entries[seq] = entry
        return entry

    def ack(self, entry: SpoolEntry) -> None:
        """Replay acknowledged ``entry``: delete its file (fsync dir). Acking twice is a no-op."""
        with self._lock:
            if self._entries.pop(entry.seq, None) is None:
                return
        entry.path.unlink(missing_ok=True)
        _fsync_dir(self.dir)

    # ---- read / verify ----------------------------------------------------------------------------
    def load(self, entry: SpoolEntry) -> pa.Table:
        """Read and verify an entry's table. Raises ``SpoolCorruptError`` naming the file and reason."""
        return _verified_table(entry.path, entry.crc32)

    def pending(self) -> list[SpoolEntry]:
        """Entries not yet acknowledged, oldest first."""
        with self._lock:
            return [self._entries[s] for s in sorted(self._entries)]

    def full(self) -> bool:
        """True while pending groups ≥ ``max_groups`` or pending bytes ≥ ``max_bytes`` (lease no prompt)."""
        with self._lock:
            return (len(self._entries) >= self.max_groups
                    or sum(e.nbytes for e in self._entries.values()) >= self.max_bytes)

    def stats(self) -> SpoolStats:
        with self._lock:
            entries = list(self._entries.values())
            quarantined = self._quarantined
        oldest = min((e.created_at for e in entries), default=None)
        age = 0.0 if oldest is None else max(self._clock() - oldest, 0.0)
        return SpoolStats(len(entries), sum(e.nbytes for e in entries), age, quarantined)

    # ---- startup / quarantine ---------------------------------------------------------------------
    def recover(self) -> list[SpoolEntry]:
        """Startup: remove temp files of interrupted puts, verify every entry file, quarantine the bad
        ones (and any unrecognised file), and make the valid ones pending; returns them, oldest first."""
        valid: dict[int, SpoolEntry] = {}
        changed = False
        for path in sorted(self.dir.iterdir()):
            if path.name == QUARANTINE and path.is_dir():
                continue
            if path.name.startswith(_TMP_PREFIX):
                log.warning("spool_temp_removed", file=str(path), reason="interrupted put (crash before rename)")
                path.unlink()
                changed = True
                continue
            m = _ENTRY.match(path.name)
            try:
                if m is None:
                    raise SpoolCorruptError(f"spool file {path}: unrecognised name (expected "
                                            "'{seq:012d}-{crc32:08x}.arrow')")
                _verified_table(path, int(m.group(2), 16))
            except SpoolCorruptError as exc:
                self.quarantine(path, str(exc))
                continue
            st = path.stat()
            seq = int(m.group(1))
            valid[seq] = SpoolEntry(seq, path, st.st_size, int(m.group(2), 16), st.st_mtime)
        if changed:
            _fsync_dir(self.dir)
        with self._lock:
            self._entries = valid
            self._next_seq = max(self._next_seq, max(valid, default=-1) + 1)
        return self.pending()

    def quarantine(self, target: SpoolEntry | Path, reason: str) -> Path:
        """Move a file to ``quarantine/`` (never loaded again), log it with ``reason``; returns the new path."""
        path = target.path if isinstance(target, SpoolEntry) else Path(target)
        self.quarantine_dir.mkdir(exist_ok=True)
        dest = self.quarantine_dir / path.name
        n = 1
        while dest.exists():
            dest, n = self.quarantine_dir / f"{path.name}.{n}", n + 1
        os.rename(path, dest)
        _fsync_dir(self.quarantine_dir)
        _fsync_dir(self.dir)
        with self._lock:
            if isinstance(target, SpoolEntry):
                self._entries.pop(target.seq, None)
            self._quarantined += 1
        log.error("spool_quarantined", file=str(path), moved_to=str(dest), reason=reason)
        return dest


def _verified_table(path: Path, crc32: int) -> pa.Table:
    try:
        payload = path.read_bytes()
    except OSError as exc:
        raise SpoolCorruptError(f"spool file {path}: unreadable: {exc}") from exc
    got = zlib.crc32(payload)
    if got != crc32:
        raise SpoolCorruptError(f"spool file {path}: crc32 {got:08x} of its {len(payload)} bytes does not match "
                                f"{crc32:08x} in its name (truncated or changed)")
    try:
        return read_ipc(payload, f"spool file {path}")  # a spool written before an upgrade is read too
    except SchemaError as exc:
        raise SpoolCorruptError(f"spool file {path}: not a valid trajectory table: {exc}") from exc


def refused(exc: BaseException) -> bool:
    """True if replay refused a batch for good (re-sending the same bytes fails again): a
    ``ValueError`` (``SchemaError`` from an in-process replay) or a gRPC error in ``REFUSED_CODES``."""
    if isinstance(exc, ValueError):
        return True
    code = getattr(exc, "code", None)
    return callable(code) and getattr(code(), "name", None) in REFUSED_CODES


class SpoolFlusher:
    """Delivers spool entries to replay in put order; acks an entry once replay acknowledged it.

    Args:
        spool: the spool to drain.
        insert: ``await insert(table)`` returns once replay acknowledged the table; it retries
            ``ConnectionError`` itself (``RolloutWorker._insert_with_retry``) and raises anything else.

    An entry that fails verification, or that replay refuses for good (``refused``), is quarantined
    and logged; the flusher moves on. Any other error propagates (the worker fails loudly).
    """

    def __init__(self, spool: Spool, insert: Callable[[pa.Table], Awaitable[object]]) -> None:
        self.spool, self._insert = spool, insert
        self.delivered = 0
        """Entries acknowledged by replay and removed from the spool."""

    async def flush_once(self) -> int:
        """Deliver every entry pending now, oldest first; returns how many were delivered."""
        loop = asyncio.get_running_loop()
        done = 0
        for entry in self.spool.pending():
            try:
                table = await loop.run_in_executor(None, self.spool.load, entry)
            except SpoolCorruptError as exc:
                await loop.run_in_executor(None, self.spool.quarantine, entry, str(exc))
                continue
            try:
                await self._insert(table)
            except Exception as exc:  # recovery path: a refused entry must not block the spool forever
                if not refused(exc):
                    raise
                await loop.run_in_executor(None, self.spool.quarantine, entry,
                                           f"replay refused it: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            fault_point("rollout.spool.flush")
            await loop.run_in_executor(None, self.spool.ack, entry)
            self.delivered += 1
            done += 1
        return done

    async def run(self, wakeup: asyncio.Event, poll_s: float = 0.5) -> None:
        """Flush forever (until cancelled): after each pass wait for ``wakeup`` (a put) or ``poll_s`` seconds."""
        while True:
            wakeup.clear()
            await self.flush_once()
            if not self.spool.pending():
                try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel (gh-86296)
                    async with asyncio.timeout(poll_s):
                        await wakeup.wait()
                except TimeoutError:
                    pass

    async def drain(self, timeout_s: float) -> int:
        """Flush until the spool is empty or ``timeout_s`` seconds passed; returns groups left pending.
        Call it only while no ``run`` task flushes the same spool (e.g. after ``RolloutWorker.run`` returned)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._drain()
        except TimeoutError:
            pass
        return len(self.spool.pending())

    async def _drain(self) -> None:
        while self.spool.pending():
            await self.flush_once()
