"""File plumbing shared by the WAL and snapshots: directory fsync, a hashing writer, verified reads."""

from __future__ import annotations

import ctypes
import hashlib
import os
import queue
import threading
import time
from pathlib import Path

import pyarrow as pa

from gyre.utils.durable import fsync_path
from gyre.replay.types import SnapshotError

fsync_dir = fsync_path
"""fsync a directory so that file creations, renames and deletions in it are durable (``utils.durable``)."""


def _libc_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux: fall back to fdatasync
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SFR_WAIT_WRITE_WAIT = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER


def drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Advise the kernel to drop ``fd``'s cached pages in ``[offset, offset + length)`` bytes
    (``length`` 0: to the end of the file): ``posix_fadvise(POSIX_FADV_DONTNEED)``. Linux drops the
    clean pages wholly inside the range, starts writeback of dirty ones and leaves them, and keeps
    pages a process has mapped. For files written once and read only by a restore (WAL segments,
    snapshots): caching them evicts everything else's pages and, once the cache has filled memory,
    makes every new page wait for reclaim (PostgreSQL drops its WAL segments the same way).
    Advice only: where the call is missing or refused, the pages stay cached."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:  # not POSIX (no page cache advice): the pages stay cached
        return
    try:
        fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError:  # e.g. a filesystem that takes no advice: the pages stay cached
        pass


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


class ForegroundGate:
    """Foreground first: a snapshot's background steps wait while foreground work is in flight.

    Foreground work is what an RPC waits for: a WAL fsync (it acknowledges inserts) and an insert's
    validate/split/log/apply step. Each is wrapped in ``urgent()``. A snapshot competes with them for
    the disk queue (with ext4's ordered journal, a commit also waits for data blocks allocated
    meanwhile), for the two cores and for the GIL; so before each step — writing a record batch,
    hashing and writing back a 1 MiB range, truncating a chunk of an old file — it calls
    ``wait_turn()``, which returns once every urgent section that was in flight when it was called has
    finished (never later than ``max_wait_s`` seconds). It waits for those only, not for later ones,
    so a busy server cannot starve a snapshot: at worst steps and foreground work alternate. (The same
    idea as RocksDB's write-stall-free background I/O: a rate limiter favouring foreground writes.)

    Waiting for the sections in flight is not enough on a small machine: a step's native work (Arrow
    encoding, sha256, writeback) runs without the GIL, but every return from it takes the GIL back
    from an insert thread (a forced switch after ``sys.getswitchinterval()``), and three helper threads
    doing that per MiB stretched the insert p99 from ~4.5 ms (no snapshot) to ~10 ms during one, on
    2 cores (``bench.replay``; 7 ms with a 1 ms pause). So while the server is busy (foreground work started within ``busy_s``), each
    step also sleeps ``pause_s`` first: at most one step per pause per helper thread, about 1 GB/s
    per helper at 1 ms per 1 MiB step. An idle server's snapshot runs at full speed.

    Args:
        max_wait_s: longest ``wait_turn`` waits for the sections in flight (seconds).
        pause_s: sleep of each background step while the server is busy (seconds; 0: none).
        busy_s: how recent foreground work must be for the server to count as busy (seconds).
    """

    def __init__(self, max_wait_s: float = 0.05, pause_s: float = 0.0, busy_s: float = 0.01) -> None:
        self.max_wait_s = max_wait_s
        self.pause_s = pause_s
        """Seconds each background step sleeps while the server is busy (0: never)."""
        self.busy_s = busy_s
        """The server counts as busy while foreground work started less than this many seconds ago."""
        self._cv = threading.Condition()
        self._started = 0
        self._finished = 0
        self._last_start = float("-inf")
        self.waits = 0
        """``wait_turn`` calls that found foreground work in flight (for tests and forensics)."""

    class _Urgent:
        def __init__(self, gate: "ForegroundGate") -> None:
            self.gate = gate

        def __enter__(self) -> None:
            with self.gate._cv:
                self.gate._started += 1
                self.gate._last_start = time.monotonic()

        def __exit__(self, *exc) -> None:
            with self.gate._cv:
                self.gate._finished += 1
                self.gate._cv.notify_all()

    def urgent(self) -> "_Urgent":
        """Context manager around one piece of foreground work (an exception inside still counts as
        finished). Re-entrant use from one thread is fine: sections only count."""
        return self._Urgent(self)

    def wait_turn(self, timeout_s: float | None = None) -> None:
        """Block until the urgent sections in flight now have finished, at most ``timeout_s`` seconds
        (default ``max_wait_s``); then, if foreground work started within the last ``busy_s`` seconds,
        sleep ``pause_s`` (the GIL and the core released) before the caller's next step."""
        with self._cv:
            target = self._started
            if self._finished < target:
                self.waits += 1
                self._cv.wait_for(lambda: self._finished >= target,
                                  timeout=self.max_wait_s if timeout_s is None else timeout_s)
            busy = time.monotonic() - self._last_start < self.busy_s
        if busy and self.pause_s:
            time.sleep(self.pause_s)


_DELETE_CHUNK = 8 << 20
"""Bytes ``remove_gently`` frees per step."""


def mapped_here(path: Path) -> bool:
    """Whether this process may memory-map ``path``: its inode appears in ``/proc/self/maps`` (inode only, so
    a renamed file still counts; a same-numbered inode of another device is a harmless false positive).
    ``True`` where it cannot tell (no ``/proc``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    inode = str(os.stat(path).st_ino)
    try:
        with open("/proc/self/maps") as f:
            return any(len(fields) >= 5 and fields[4] == inode for fields in (line.split(maxsplit=5) for line in f))
    except OSError:
        return True


def remove_gently(path: Path, gate: ForegroundGate | None = None, chunk: int = _DELETE_CHUNK) -> None:
    """Delete a (large) file in steps: truncate it ``chunk`` bytes at a time from the end, letting the
    foreground work in flight finish before each step (``gate``), then unlink it. One unlink of a
    multi-hundred-MB file is one long ext4 journal update that a concurrent WAL fsync waits behind
    (a 200 MB snapshot's unlink put 12-30 ms into insert acks here); short steps keep each update small.
    RocksDB deletes SST files the same way (``DeleteScheduler``, ``bytes_max_delete_chunk``). Only for
    files nothing needs any more: a crash mid-way leaves a shorter file. A missing file is no error.

    A file this process memory-maps (``mapped_here``) is only unlinked: a restore reads snapshot files and
    WAL segments zero-copy, so the tables restored from them point into the mapping, and shortening the
    file would pull those pages from under them (SIGBUS at the next read, e.g. the next snapshot's write).
    Unlinked, its blocks are freed when the last buffer into it is."""
    try:
        size = path.stat().st_size
        if size > chunk and mapped_here(path):
            size = 0
    except FileNotFoundError:
        return
    if size > chunk:
        fd = os.open(path, os.O_WRONLY)
        try:
            while size > chunk:
                if gate is not None:
                    gate.wait_turn()
                size -= chunk
                os.ftruncate(fd, size)
        finally:
            os.close(fd)
    if gate is not None:
        gate.wait_turn()
    path.unlink(missing_ok=True)


class HashingFile:
    """A new file written natively by Arrow (``sink``: no Python call, and no GIL held, while Arrow
    encodes and writes), hashed and written back by two helper threads trailing the writer.

    The writer calls ``written()`` after each record batch. Every completed 1 MiB range is then (1)
    written back (``sync_file_range``, else ``fdatasync``) and (2) read back from the page cache and
    fed to sha256, in order, so writing, hashing and the disk overlap instead of adding up. The writer
    waits in ``written()`` while two ranges wait behind the one in writeback: a snapshot never piles
    up more than ~3 MiB of dirty pages, and a WAL fsync (inserts waiting for their ack) queues behind
    at most one 1 MiB range (~3 ms at 300 MB/s) instead of a multi-GB writeback; with a ``gate`` the
    flusher, the hasher and the writer also let the foreground work in flight (WAL fsyncs, inserts)
    finish before each step (the helpers run at low CPU and I/O priority too). Durability
    comes from ``close()``'s fsync (``sync_file_range`` alone persists no metadata). Hashing what was
    written (not what was handed over) also catches a bad write.

    With ``drop_cache``, each range leaves the page cache (``drop_cached``) once it is both hashed
    and written back, and the whole file once ``close()`` fsync'd it: writing a snapshot then takes
    no more memory than the ranges in flight, its new pages reuse the ones just dropped, and it never
    pushes the page cache into reclaim (at 1M stored trajectories here, three 2-6 GB snapshots filled
    24 GB with cache, and kswapd's reclaim then slowed inserts and the snapshot itself).

    Raises:
        FileExistsError: ``path`` exists (from the constructor).
    """

    _RANGE = 1 << 20
    """Bytes per writeback/hash step: what a WAL fsync may have to wait behind (1 MiB: ~3 ms at
    300 MB/s; 8 MiB ranges put 20-30 ms into the insert p99 while a snapshot ran)."""
    _QUEUED = 2
    """Ranges that may wait behind the one in writeback before the writer waits."""

    def __init__(self, path: Path, gate: ForegroundGate | None = None, drop_cache: bool = False) -> None:
        self.gate, self.drop_cache = gate, drop_cache
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        self.sink = pa.OSFile(str(path), mode="a")
        """Where Arrow writes (the same file, appended to natively)."""
        self.sha, self.size, self.closed = hashlib.sha256(), 0, False
        self._queued = 0  # bytes handed to the helpers
        self._error: OSError | None = None
        self._done = {"hashed": 0, "flushed": 0}  # bytes from the start that each helper finished
        self.dropped = 0
        """Bytes from the start of the file dropped from the page cache (``drop_cache``)."""
        self._drop_lock = threading.Lock()
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
            if self.gate is not None:
                self.gate.wait_turn()
            try:
                while n:
                    got = os.preadv(self.fd, [view[:n]], start)
                    if got <= 0:
                        raise OSError(f"short read at byte {start} of a snapshot file being hashed")
                    self.sha.update(view[:got])  # hashlib releases the GIL on large buffers
                    start, n = start + got, n - got
            except OSError as exc:
                self._error = self._error or exc
            self._finished("hashed", span[0] + span[1])

    def _flush(self) -> None:
        _background()
        while (span := self._flush_q.get()) is not None:
            if self._error is not None:
                continue  # keep draining so the writer never blocks; close() raises the error
            try:
                if self.gate is not None:
                    self.gate.wait_turn()
                if _SYNC_FILE_RANGE is None or _SYNC_FILE_RANGE(self.fd, span[0], span[1], _SFR_WAIT_WRITE_WAIT):
                    os.fdatasync(self.fd)  # no sync_file_range here (or it failed): the portable way
            except OSError as exc:
                self._error = self._error or exc
                continue
            self._finished("flushed", span[0] + span[1])

    def _finished(self, step: str, end: int) -> None:
        """A helper finished its ``step`` for the bytes before ``end``: with ``drop_cache``, drop what
        both helpers have finished and is not dropped yet (never a byte still to be hashed or written back)."""
        if not self.drop_cache or self._error is not None:
            return
        with self._drop_lock:
            self._done[step] = end
            start, self.dropped = self.dropped, max(self.dropped, min(self._done.values()))
            end = self.dropped
        if end > start:
            drop_cached(self.fd, start, end - start)

    def _queue(self, end: int) -> None:
        while self._queued < end:
            n = min(self._RANGE, end - self._queued)
            self._hash_q.put((self._queued, n))
            self._flush_q.put((self._queued, n))  # blocks while _QUEUED ranges wait behind the one in writeback
            self._queued += n

    def written(self) -> None:
        """Hand every completed range to the helpers (waits while the writeback queue is full), then
        wait for the foreground work in flight (``gate``) before the writer's next step."""
        end = self.sink.tell()
        self._queue(end - end % self._RANGE)
        if self.gate is not None:
            self.gate.wait_turn()

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
            if self.drop_cache:
                drop_cached(self.fd)
                self.dropped = self.size
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
