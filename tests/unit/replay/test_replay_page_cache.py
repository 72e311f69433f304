"""The WAL and snapshot files leave the OS page cache once durable (``wal.drop_page_cache``,
``snapshot.drop_page_cache``): what is dropped, when, and that the data reads back the same."""

import ctypes
import hashlib
import mmap
import os
import sys

import numpy as np
import pyarrow as pa
import pytest

from gyre.replay import files
from gyre.replay.config import WalConfig
from gyre.replay.files import HashingFile, drop_cached
from gyre.replay.records import Record, encode_parts
from gyre.replay.wal import Wal
from gyre.replay.wal_read import list_segments, read_segment

PAGE = mmap.PAGESIZE


def resident_pages(path) -> int:
    """Pages of ``path`` in the page cache (Linux ``mincore`` on a mapping nothing touches)."""
    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as mm:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
        try:
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(b & 1 for b in vec.raw)
        finally:
            del addr  # the exported buffer must be gone before the mapping closes
            import gc
            gc.collect()


@pytest.fixture
def advice_works(tmp_path):
    """Skip where this filesystem ignores POSIX_FADV_DONTNEED (tmpfs keeps its pages: they are the file)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("page cache residency is read with Linux mincore")
    probe = tmp_path / "probe.bin"
    with open(probe, "wb") as f:
        f.write(b"x" * (64 * PAGE))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the kernel's answer, not drop_cached's
    if resident_pages(probe) > 8:
        pytest.skip(f"{tmp_path}'s filesystem keeps pages after POSIX_FADV_DONTNEED")
    probe.unlink()


def write_table(path, table, drop_cache, gate=None):
    sink = HashingFile(path, gate, drop_cache)
    with pa.ipc.new_file(sink.sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=100_000):
            writer.write_batch(batch)
            sink.written()
    sink.close()
    return sink


def test_a_snapshot_file_leaves_the_page_cache_and_reads_back_the_same(tmp_path, advice_works):
    table = pa.table({"x": np.arange(2_000_000, dtype=np.int64)})  # 16 MB: sixteen 1 MiB ranges
    kept = write_table(tmp_path / "kept.arrow", table, drop_cache=False)
    dropped = write_table(tmp_path / "dropped.arrow", table, drop_cache=True)
    pages = -(-dropped.size // PAGE)
    assert resident_pages(tmp_path / "kept.arrow") > pages // 2  # the control: written pages stay cached
    assert resident_pages(tmp_path / "dropped.arrow") <= 2
    assert dropped.dropped == dropped.size
    data = (tmp_path / "dropped.arrow").read_bytes()
    assert dropped.sha.hexdigest() == kept.sha.hexdigest() == hashlib.sha256(data).hexdigest()
    assert pa.ipc.open_file(pa.py_buffer(data)).read_all().equals(table)


def test_a_range_is_dropped_only_once_hashed_and_written_back(tmp_path, monkeypatch):
    """Every drop covers bytes both helpers have finished, the drops never overlap, and together with
    close()'s they cover the file."""
    drops = []
    sinks = []

    def record(fd, offset=0, length=0):
        sink = sinks[0]
        drops.append((offset, length, dict(sink._done), sink.closed))

    monkeypatch.setattr(files, "drop_cached", record)
    table = pa.table({"x": np.arange(1_500_000, dtype=np.int64)})  # 12 MB
    path = tmp_path / "t.arrow"
    orig_init = HashingFile.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        sinks.append(self)

    monkeypatch.setattr(HashingFile, "__init__", init)
    sink = write_table(path, table, drop_cache=True)
    ranged = [(o, n, done) for o, n, done, _ in drops if n]
    assert len(ranged) >= 5  # dropped as it went, not only at the end
    at = 0
    for offset, length, done in ranged:
        assert offset == at and offset + length <= min(done.values())
        at = offset + length
    assert drops[-1][:2] == (0, 0) and drops[-1][3]  # the whole file, once close() fsync'd it
    assert sink.dropped == sink.size == os.path.getsize(path)


def test_a_failed_write_back_drops_nothing_more(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(files, "drop_cached", lambda fd, offset=0, length=0: calls.append((offset, length)))
    monkeypatch.setattr(files, "_SYNC_FILE_RANGE", None)

    def broken(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(files.os, "fdatasync", broken)
    with pytest.raises(OSError, match="Input/output error"):
        write_table(tmp_path / "t.arrow", pa.table({"x": np.arange(1_000_000, dtype=np.int64)}), drop_cache=True)
    assert calls == []


def test_drop_cached_is_advice_and_never_raises(tmp_path):
    r, w = os.pipe()
    try:
        drop_cached(r)  # ESPIPE: the pages (none) stay; no error
    finally:
        os.close(r)
        os.close(w)


def insert(payload: bytes) -> list:
    return encode_parts(Record("insert", {}, payload))


@pytest.mark.parametrize("drop", [True, False])
def test_the_wal_leaves_the_page_cache_once_fsynced_and_replays_the_same(tmp_path, advice_works, drop):
    wal = Wal(tmp_path / "wal", WalConfig(segment_bytes=1 << 20, drop_page_cache=drop), next_lsn=0)
    payloads = [os.urandom(256 * 1024) for _ in range(12)]  # three 1 MiB segments and part of a fourth
    for payload in payloads:
        wal.wait(wal.append([insert(payload)]))
    segments = wal.segments()
    assert len(segments) == 4
    cached = [resident_pages(p) for p in segments]
    if drop:
        assert max(cached) <= 1  # at most the page still being appended to
    else:
        assert sum(cached) > sum(-(-os.path.getsize(p) // PAGE) for p in segments) // 2
    wal.close()
    got = [r.payload.to_pybytes() for path in list_segments(tmp_path / "wal") for r in read_segment(path).records]
    assert got == payloads


@pytest.mark.parametrize("durability", ["write", "buffered"])
def test_without_fsync_the_log_is_dropped_only_once_close_fsyncd_it(tmp_path, monkeypatch, durability):
    """Dropping dirty pages would only start their writeback on the appending thread: not before close."""
    fds = []
    monkeypatch.setattr("gyre.replay.wal.drop_cached", lambda fd, offset=0, length=0: fds.append((offset, length)))
    wal = Wal(tmp_path / "wal", WalConfig(durability=durability, segment_bytes=1 << 20), next_lsn=0)
    for _ in range(9):
        wal.wait(wal.append([insert(os.urandom(256 * 1024))]))
    assert len(wal.segments()) == 3 and fds == []
    wal.close()
    assert fds == [(0, 0)]  # the last segment, once close() fsync'd it (the sealed ones were closed before)
