"""File plumbing shared by the WAL and snapshots: directory fsync, a hashing writer, verified reads."""

from __future__ import annotations

import ctypes
import hashlib
import os
import queue
import threading
from pathlib import Path

import pyarrow as pa

from proto.durable import fsync_path
from replay.types import SnapshotError

fsync_dir = fsync_path
"""fsync a directory so that file creations, renames and deletions in it are durable (``proto.durable``)."""


def _libc_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux: fall back to fdatasync
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SFR_WAIT_WRITE_WAIT = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER


def _background(niceness: int = 10) -> None:
    """Lower the calling thread's CPU priority and its I/O priority (Linux: per thread; best-effort
    class, lowest level, via psutil), so a snapshot's encoding, hashing and writeback yield the cores
    to inserts and samples and the disk queue to the WAL's fsyncs (which acknowledge inserts)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except (AttributeError, OSError):  # no per-thread priorities here: run at normal priority
        pass
    try:
        import psutil
    except ImportError:  # no psutil here: normal I/O priority
        return
    try:
        psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_BE, 7)
    except (AttributeError, ValueError, OSError, psutil.Error):  # not Linux: normal I/O priority
        pass


def run_in_background(fn, *args):
    """``fn(*args)`` on a fresh thread at lowered CPU priority (``_background``); waits for it and
    returns its result or raises its exception. The caller's own priority is untouched (an
    unprivileged thread could not raise it back)."""
    out: list = []

    def run() -> None:
        _background()
        try:
            out.append((True, fn(*args)))
        except BaseException as exc:  # handed to the caller below
            out.append((False, exc))

    thread = threading.Thread(target=run, name="replay-snapshot-writer", daemon=True)
    thread.start()
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


class HashingFile:
    """A new file written natively by Arrow (``sink``: no Python call, and no GIL held, while Arrow
    encodes and writes), hashed and written back by two helper threads trailing the writer.

    The writer calls ``written()`` after each record batch. Every completed 8 MiB range is then (1)
    written back (``sync_file_range``, else ``fdatasync``) and (2) read back from the page cache and
    fed to sha256, in order, so writing, hashing and the disk overlap instead of adding up. The writer
    waits in ``written()`` while two ranges wait behind the one in writeback: a snapshot never piles
    up more than ~24 MiB of dirty pages, and the WAL's fsyncs (inserts waiting for their ack) do not
    queue behind a multi-GB writeback (the helpers also run at low CPU and I/O priority). Durability
    comes from ``close()``'s fsync (``sync_file_range`` alone persists no metadata). Hashing what was
    written (not what was handed over) also catches a bad write.

    Raises:
        FileExistsError: ``path`` exists (from the constructor).
    """

    _RANGE = 8 << 20
    """Bytes per writeback/hash step."""
    _QUEUED = 2
    """Ranges that may wait behind the one in writeback before the writer waits."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self.sink = pa.OSFile(str(path), mode="a")
        """Where Arrow writes (the same file, appended to natively)."""
        self.sha, self.size, self.closed = hashlib.sha256(), 0, False
        self._queued = 0  # bytes handed to the helpers
        self._error: OSError | None = None
        self._hash_q: queue.SimpleQueue = queue.SimpleQueue()
        self._flush_q: queue.Queue = queue.Queue(maxsize=self._QUEUED)  # a full queue paces the writer
        self._threads = [threading.Thread(target=self._hash, daemon=True),
                         threading.Thread(target=self._flush, daemon=True)]
        for t in self._threads:
            t.start()

    def _hash(self) -> None:
        _background()
        view = memoryview(bytearray(self._RANGE))
        while (span := self._hash_q.get()) is not None:
            start, n = span
            try:
                while n:
                    got = os.preadv(self.fd, [view[:n]], start)
                    if got <= 0:
                        raise OSError(f"short read at byte {start} of a snapshot file being hashed")
                    self.sha.update(view[:got])  # hashlib releases the GIL on large buffers
                    start, n = start + got, n - got
            except OSError as exc:
                self._error = self._error or exc

    def _flush(self) -> None:
        _background()
        while (span := self._flush_q.get()) is not None:
            if self._error is not None:
                continue  # keep draining so the writer never blocks; close() raises the error
            try:
                if _SYNC_FILE_RANGE is None or _SYNC_FILE_RANGE(self.fd, span[0], span[1], _SFR_WAIT_WRITE_WAIT):
                    os.fdatasync(self.fd)  # no sync_file_range here (or it failed): the portable way
            except OSError as exc:
                self._error = self._error or exc

    def _queue(self, end: int) -> None:
        while self._queued < end:
            n = min(self._RANGE, end - self._queued)
            self._hash_q.put((self._queued, n))
            self._flush_q.put((self._queued, n))  # blocks while _QUEUED ranges wait behind the one in writeback
            self._queued += n

    def written(self) -> None:
        """Hand every completed range to the helpers (waits while the writeback queue is full)."""
        end = self.sink.tell()
        self._queue(end - end % self._RANGE)

    def close(self) -> None:
        """Close the sink, hash and write back the rest, fsync and close. Raises ``OSError``."""
        if self.closed:
            return
        self.closed = True
        try:
            try:
                self.sink.close()
                self.size = os.fstat(self.fd).st_size
                self._queue(self.size)
            finally:
                self._hash_q.put(None)
                self._flush_q.put(None)
                for t in self._threads:
                    t.join()
            if self._error is not None:
                raise self._error
            os.fsync(self.fd)
        finally:
            os.close(self.fd)


def read_verified(snap: Path, name: str, want: dict) -> pa.Buffer:
    """``snap/name``'s bytes, memory-mapped (no copy: Arrow tables read from it point into the page
    cache) and checked against the manifest entry ``want`` (size, sha256) before anything parses them.

    Raises:
        SnapshotError: missing, wrong size, or wrong hash (the message names the snapshot and file).
    """

    path = snap / name
    if not path.is_file():
        raise SnapshotError(f"snapshot {snap}: {name} is missing")
    size = path.stat().st_size
    if size != want["bytes"]:
        raise SnapshotError(f"snapshot {snap}: {name} has {size} bytes; manifest says {want['bytes']} (truncated?)")
    if size == 0:
        buf = pa.py_buffer(b"")
    else:
        with pa.memory_map(str(path)) as mm:  # the mapping lives as long as buffers point into it
            buf = mm.read_buffer()
    digest = hashlib.sha256(buf).hexdigest()  # releases the GIL
    if digest != want["sha256"]:
        raise SnapshotError(f"snapshot {snap}: {name} sha256 {digest[:16]}… does not match the manifest "
                            f"({want['sha256'][:16]}…)")
    return buf
