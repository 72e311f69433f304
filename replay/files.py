"""File plumbing shared by the WAL and snapshots: directory fsync, a hashing writer, verified reads."""

from __future__ import annotations

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


class HashingFile:
    """File-like sink for Arrow's writer: writes with ``os.write`` while a helper thread computes the
    sha256 of the same bytes, and a second one starts writeback (``fdatasync``) every 64 MiB, so hashing,
    writing and the disk overlap instead of adding up. Arrow hands large bodies over as zero-copy
    ``pa.Buffer``s of the table being written, which stay valid while queued here; small pieces
    (metadata, offsets) are coalesced into 1 MiB writes."""

    _FLUSH_EVERY = 64 << 20
    _SMALL = 64 << 10

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.sha, self.size, self.closed = hashlib.sha256(), 0, False
        self._small = bytearray()
        self._unflushed = 0
        self._hash_q: queue.SimpleQueue = queue.SimpleQueue()
        self._flush_q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._hash, daemon=True),
                         threading.Thread(target=self._flush, daemon=True)]
        for t in self._threads:
            t.start()

    def _hash(self) -> None:
        while (data := self._hash_q.get()) is not None:
            self.sha.update(data)

    def _flush(self) -> None:
        while self._flush_q.get() is not None:
            os.fdatasync(self.fd)

    def _write(self, data) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        self._unflushed += len(data)
        if self._unflushed >= self._FLUSH_EVERY:
            self._flush_q.put(True)
            self._unflushed = 0

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
