"""File plumbing shared by the WAL and snapshots: directory fsync, a hashing writer, verified reads."""

from __future__ import annotations

import ctypes
import hashlib
import os
import queue
import threading
from pathlib import Path

import pyarrow as pa

from replay.types import SnapshotError


def fsync_dir(path: Path) -> None:
    """fsync a directory so that file creations, renames and deletions in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    """Lower the calling thread's CPU priority (Linux: per thread), so a snapshot's hashing and
    writeback yield the cores to inserts and samples; they hold the GIL only between chunks."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):  # no per-thread priorities here: run at normal priority
        pass


class HashingFile:
    """File-like sink for Arrow's writer: writes with ``os.write`` while a helper thread computes the
    sha256 of the same bytes, and a second one writes back every 8 MiB range as soon as it is written
    (``sync_file_range``, else ``fdatasync``), so hashing, writing and the disk overlap instead of
    adding up. The writer waits when two ranges are still in writeback: a snapshot therefore never
    piles up more than ~24 MiB of dirty pages, and the WAL's fsyncs (inserts waiting for their ack)
    do not queue behind a multi-GB writeback. Arrow hands large bodies over as zero-copy
    ``pa.Buffer``s of the table being written, which stay valid while queued here; small pieces
    (metadata, offsets) are coalesced into 1 MiB writes. Durability still comes from ``close()``'s
    fsync (``sync_file_range`` alone persists no metadata)."""

    _FLUSH_EVERY = 8 << 20
    _SMALL = 64 << 10

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.sha, self.size, self.closed = hashlib.sha256(), 0, False
        self._small = bytearray()
        self._written = self._flushed = 0  # bytes written / handed to writeback
        self._flush_error: OSError | None = None
        self._hash_q: queue.SimpleQueue = queue.SimpleQueue()
        self._flush_q: queue.Queue = queue.Queue(maxsize=2)  # ranges in writeback; a full queue paces writes
        self._threads = [threading.Thread(target=self._hash, daemon=True),
                         threading.Thread(target=self._flush, daemon=True)]
        for t in self._threads:
            t.start()

    def _hash(self) -> None:
        _background()
        while (data := self._hash_q.get()) is not None:
            self.sha.update(data)

    def _flush(self) -> None:
        _background()
        while (span := self._flush_q.get()) is not None:
            if self._flush_error is not None:
                continue  # keep draining so the writer never blocks; close() raises the error
            try:
                if _SYNC_FILE_RANGE is None or _SYNC_FILE_RANGE(self.fd, span[0], span[1], _SFR_WAIT_WRITE_WAIT):
                    os.fdatasync(self.fd)  # no sync_file_range here (or it failed): the portable way
            except OSError as exc:
                self._flush_error = exc

    def _write(self, data) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        self._written += len(data)
        if self._written - self._flushed >= self._FLUSH_EVERY:
            self._flush_q.put((self._flushed, self._written - self._flushed))  # blocks while 2 are pending
            self._flushed = self._written

    def write(self, data) -> int:
        n = len(data)
        self._hash_q.put(data)  # hashed in write order
        self.size += n
        if n < self._SMALL:
            self._small += data
            if len(self._small) >= 16 * self._SMALL:
                self._write(self._small)
                self._small = bytearray()
        else:
            if self._small:
                self._write(self._small)
                self._small = bytearray()
            self._write(data)
        return n

    def flush(self) -> None:
        pass

    def close(self) -> None:
        """Write what is buffered, wait for the hash, fsync and close."""
        if not self.closed:
            if self._small:
                self._write(self._small)
            self._hash_q.put(None)
            self._flush_q.put(None)
            for t in self._threads:
                t.join()
            if self._flush_error is not None:
                os.close(self.fd)
                self.closed = True
                raise self._flush_error
            os.fsync(self.fd)
            os.close(self.fd)
            self.closed = True


def read_verified(snap: Path, name: str, want: dict) -> pa.Buffer:
    """``snap/name``'s bytes, read once and checked against the manifest entry ``want`` (size, sha256).

    Raises:
        SnapshotError: missing, wrong size, or wrong hash (the message names the snapshot and file).
    """

    path = snap / name
    if not path.is_file():
        raise SnapshotError(f"snapshot {snap}: {name} is missing")
    size = path.stat().st_size
    if size != want["bytes"]:
        raise SnapshotError(f"snapshot {snap}: {name} has {size} bytes; manifest says {want['bytes']} (truncated?)")
    buf = pa.allocate_buffer(size)
    with open(path, "rb", buffering=0) as f:
        view, got = memoryview(buf), 0
        while got < size and (n := f.readinto(view[got:])):
            got += n
    digest = hashlib.sha256(buf).hexdigest()
    if got != size or digest != want["sha256"]:
        raise SnapshotError(f"snapshot {snap}: {name} sha256 {digest[:16]}… does not match the manifest "
                            f"({want['sha256'][:16]}…)")
    return buf
