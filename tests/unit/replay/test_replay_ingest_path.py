"""The insert path: aligned Arrow payloads, leader/follower group commit, CRC-32C WAL
records (format 2) next to readable format-1 (zlib crc32) segments, and WAL-first snapshot writeback."""

import hashlib
import json
import os
import threading
import time
import zlib

import google_crc32c
import pyarrow as pa
import pytest

from gyre.proto.trajectory import to_ipc
from gyre.replay import files as files_mod
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig, WalConfig
from gyre.replay.files import HashingFile, ForegroundGate
from gyre.replay.records import RECORD_SCHEMAS, WAL_FORMAT_VERSION, CorruptRecordError, Record, encode
from gyre.replay.wal import Wal, segment_path
from gyre.replay.wal_read import read_segment
from gyre.services.replay.ingest import aligned as _aligned
from tests.fakes import group_table

NO_AUTO = {"interval_s": None, "wal_bytes": None}


# ---- payload alignment ---------------------------------------------------------------------------------
def test_aligned_copies_only_a_misaligned_payload():
    data = bytes(range(256)) * 100
    base = pa.py_buffer(data).address
    for offset in range(16):
        view = memoryview(data)[offset:]
        got = _aligned(view)
        assert got.address % 8 == 0 and got.to_pybytes() == data[offset:]
        assert (got.address == base + offset) == ((base + offset) % 8 == 0)  # in place iff aligned


def test_fsync_runs_on_the_waiting_thread_without_a_syncer(tmp_path, monkeypatch):
    fsynced_on = []
    real = os.fsync
    monkeypatch.setattr("gyre.replay.wal.os.fsync", lambda fd: (fsynced_on.append(threading.get_ident()), real(fd)))
    wal = Wal(tmp_path, WalConfig(), next_lsn=10)
    assert not [t for t in threading.enumerate() if t.name == "wal-sync"]
    lsn = wal.append([encode(Record("ack", {"lease_ids": ["a"]}))])
    wal.wait(lsn)
    assert lsn == 10 and set(fsynced_on) == {threading.get_ident()} and wal.fsyncs == 1  # segment (+ new dir)
    wal.wait(lsn)  # already durable: no second fsync
    assert wal.fsyncs == 1
    with pytest.raises(ValueError, match="WAL record 11 was never appended"):
        wal.wait(11)
    wal.close()


def test_a_failed_fsync_fails_the_log_once_and_for_good(tmp_path, monkeypatch):
    failures = []
    wal = Wal(tmp_path, WalConfig(), next_lsn=0, on_fail=failures.append)
    lsn = wal.append([encode(Record("ack", {"lease_ids": ["a"]}))])
    monkeypatch.setattr("gyre.replay.wal.os.fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    with pytest.raises(OSError, match="Input/output error"):
        wal.wait(lsn)
    with pytest.raises(OSError, match="failed: .*Input/output error"):
        wal.append([encode(Record("ack", {"lease_ids": ["b"]}))])
    assert len(failures) == 1 and wal.error is failures[0]


# ---- WAL format: CRC-32C (2), zlib crc32 (1) still restores -----------------------------------------
def test_checksum_is_crc32c_in_hardware_and_catches_a_flipped_byte(tmp_path):
    assert google_crc32c.implementation == "c"  # the pure-Python fallback would cost ms per insert
    assert RECORD_SCHEMAS[WAL_FORMAT_VERSION].metadata[b"gyre.wal_checksum"] == b"crc32c"
    wal = Wal(tmp_path, WalConfig(), next_lsn=0)
    wal.wait(wal.append([encode(Record("insert", {}, b"payload-bytes" * 100))]))
    wal.close()
    path = segment_path(tmp_path, 0)
    assert read_segment(path).records[0].payload.to_pybytes() == b"payload-bytes" * 100
    data = bytearray(path.read_bytes())
    data[data.index(b"payload-bytes") + 3] ^= 0x01
    path.write_bytes(bytes(data))
    scan = read_segment(path)
    assert scan.records == [] and "fails its crc32c check" in scan.error


def write_v1_segment(wal_dir, first_lsn, records):
    """A segment exactly as format 1 wrote it: ``crc32`` column, zlib CRC-32, ``gyre.wal_format`` 1."""
    schema = RECORD_SCHEMAS[1]
    wal_dir.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(segment_path(wal_dir, first_lsn)), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for rec in records:
            meta = json.dumps(rec.meta, separators=(",", ":"))
            crc = zlib.crc32(rec.payload, zlib.crc32(meta.encode(), zlib.crc32(rec.kind.encode())))
            writer.write_batch(pa.record_batch([pa.array([rec.kind]), pa.array([meta]),
                                                pa.array([rec.payload], pa.binary()),
                                                pa.array([crc], pa.uint32())], schema=schema))


def test_a_format_1_log_restores_and_keeps_restoring_after_format_2_appends(tmp_path):
    write_v1_segment(tmp_path / "wal", 0, [Record("insert", {}, to_ipc(group_table(0)))])
    config = ReplayConfig(dir=str(tmp_path), seed=0, snapshot=NO_AUTO)
    buf = TrajectoryBuffer(config)
    assert sorted(g.group_id for g in buf.state.store.groups.values()) == ["0-0"]
    assert buf.durability.report.errors == []
    buf.insert(group_table(1))  # a new segment, format 2
    buf.close()
    again = TrajectoryBuffer(config)
    assert sorted(g.group_id for g in again.state.store.groups.values()) == ["0-0", "1-0"]
    assert again.durability.report.errors == []
    again.close()


def test_a_flipped_byte_in_a_format_1_segment_names_its_crc32_check(tmp_path):
    write_v1_segment(tmp_path, 0, [Record("insert", {}, b"old-payload" * 50), Record("ack", {"lease_ids": ["x"]})])
    path = segment_path(tmp_path, 0)
    assert [r.kind for r in read_segment(path).records] == ["insert", "ack"]
    data = bytearray(path.read_bytes())
    data[data.index(b"old-payload") + 1] ^= 0x20
    path.write_bytes(bytes(data))
    scan = read_segment(path)
    assert scan.records == [] and "fails its crc32 check" in scan.error and scan.valid_after_error


def test_decode_rejects_a_batch_of_the_other_format():
    from gyre.replay.records import decode
    batch = pa.ipc.open_stream(pa.py_buffer(RECORD_SCHEMAS[2].serialize().to_pybytes()
                                            + encode(Record("ack", {"lease_ids": []})).to_pybytes())).read_next_batch()
    assert decode(batch).kind == "ack"
    with pytest.raises(CorruptRecordError, match="columns"):
        decode(batch, 1)


# ---- WAL first: snapshot writeback waits for WAL fsyncs in flight ------------------------------------
def test_gate_waits_only_for_the_fsyncs_in_flight_when_called():
    gate = ForegroundGate()
    gate.wait_turn()
    assert gate.waits == 0  # nothing in flight: no wait
    entered, released = threading.Event(), threading.Event()

    def fsync():
        with gate.urgent():
            entered.set()
            released.wait()

    t = threading.Thread(target=fsync)
    t.start()
    entered.wait()
    done = []
    waiter = threading.Thread(target=lambda: (gate.wait_turn(timeout_s=30), done.append(time.monotonic())))
    waiter.start()
    time.sleep(0.2)
    assert done == [] and gate.waits == 1  # blocked behind the fsync in flight
    with gate.urgent():  # a later fsync starting meanwhile is not waited for ...
        released.set()
        t.join()
        waiter.join(timeout=30)
        assert done  # ... the waiter went on while it still ran


def test_gate_gives_up_after_its_timeout():
    gate = ForegroundGate()
    with gate.urgent():
        t0 = time.monotonic()
        gate.wait_turn(timeout_s=0.05)
        assert 0.04 <= time.monotonic() - t0 < 5


def test_hashing_file_writes_back_in_1_mib_ranges_each_after_the_wal(tmp_path, monkeypatch):
    calls = []
    gate = ForegroundGate(max_wait_s=30)
    monkeypatch.setattr(files_mod, "_SYNC_FILE_RANGE",
                        lambda fd, start, n, flags: calls.append((start, n, gate._started - gate._finished)) or 0)
    data = os.urandom((3 << 20) + 12345)
    urgent = gate.urgent()
    urgent.__enter__()  # a WAL fsync in flight for the whole write
    sink = HashingFile(tmp_path / "snap.bin", gate)
    writer = threading.Thread(target=lambda: (sink.sink.write(data), sink.written(), sink.close()))
    writer.start()
    time.sleep(0.3)
    assert calls == []  # no writeback while the WAL fsync runs
    urgent.__exit__(None, None, None)
    writer.join(timeout=60)
    assert [(s, n) for s, n, _ in calls] == [(0, 1 << 20), (1 << 20, 1 << 20), (2 << 20, 1 << 20), (3 << 20, 12345)]
    assert all(in_flight == 0 for _, _, in_flight in calls)
    assert sink.sha.hexdigest() == hashlib.sha256(data).hexdigest() == hashlib.sha256(
        (tmp_path / "snap.bin").read_bytes()).hexdigest()



def test_remove_gently_truncates_in_steps_after_the_wal_then_unlinks(tmp_path, monkeypatch):
    path = tmp_path / "old.arrow"
    path.write_bytes(b"x" * ((20 << 20) + 5))
    sizes, real = [], os.ftruncate
    monkeypatch.setattr(files_mod.os, "ftruncate", lambda fd, n: (sizes.append(n), real(fd, n)))
    gate = ForegroundGate(max_wait_s=30)
    urgent = gate.urgent()
    urgent.__enter__()  # a WAL fsync in flight
    t = threading.Thread(target=files_mod.remove_gently, args=(path, gate, 8 << 20))
    t.start()
    time.sleep(0.3)
    assert sizes == [] and path.exists()  # waits for the fsync before the first step
    urgent.__exit__(None, None, None)
    t.join(timeout=60)
    assert sizes == [(12 << 20) + 5, (4 << 20) + 5] and not path.exists()
    files_mod.remove_gently(path)  # already gone: no error


MAPPED_THEN_REMOVED = """
import hashlib, sys
from pathlib import Path
import pyarrow as pa
from gyre.replay.files import remove_gently
path, data = Path(sys.argv[1]), bytes(range(256)) * 1024
path.write_bytes(data)
with pa.memory_map(str(path)) as mm:
    buf = mm.read_buffer()  # what a restore keeps: tables pointing into the mapping
remove_gently(path, chunk=64 * 1024)
assert not path.exists()
assert hashlib.sha256(buf).digest() == hashlib.sha256(data).digest()
"""


def test_remove_gently_never_shortens_a_file_this_process_maps(tmp_path):
    # Shortening a mapped file pulls its pages from under the buffers (SIGBUS, which would kill pytest: a subprocess)
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", MAPPED_THEN_REMOVED, str(tmp_path / "mapped.arrow")], cwd=repo,
                         env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr.decode()[-2000:])  # -7: SIGBUS


def test_mapped_here_sees_a_mapping_also_after_a_rename(tmp_path):
    plain, mapped = tmp_path / "plain", tmp_path / "mapped"
    plain.write_bytes(b"x" * 8192)
    mapped.write_bytes(b"y" * 8192)
    with pa.memory_map(str(mapped)) as mm:
        buf = mm.read_buffer()
    mapped.rename(tmp_path / "trash")
    assert files_mod.mapped_here(tmp_path / "trash") and not files_mod.mapped_here(plain)
    del buf


def test_groups_file_in_many_batches_restores_the_same_groups(tmp_path, monkeypatch):
    from gyre.replay import snapshot as snapshot_mod
    monkeypatch.setattr(snapshot_mod, "_GROUPS_PER_BATCH", 2)
    config = ReplayConfig(dir=str(tmp_path), seed=0, snapshot=NO_AUTO)
    buf = TrajectoryBuffer(config)
    for i in range(5):
        buf.insert(group_table(i))
    snap = buf.snapshot()
    want = sorted((g.key, g.group_id, g.num_rows) for g in buf.state.store.groups.values())
    buf.close()
    assert pa.ipc.open_file(pa.memory_map(str(snap / "groups.arrow"))).num_record_batches == 3
    again = TrajectoryBuffer(config)
    assert sorted((g.key, g.group_id, g.num_rows) for g in again.state.store.groups.values()) == want
    assert again.durability.report.records_replayed == 0  # all from the snapshot
    again.close()


def test_an_insert_is_foreground_work_except_while_the_rate_limiter_holds_it(tmp_path):
    from gyre.replay.rate_limiter import RateLimitedError
    config = ReplayConfig(dir=str(tmp_path), seed=0, snapshot=NO_AUTO,
                          rate_limiter={"samples_per_insert": 1.0, "error_buffer": 1.0, "min_size_to_sample": 1})
    buf = TrajectoryBuffer(config)
    gate = buf.durability.foreground
    buf.insert(group_table(0))
    assert gate._started == gate._finished == 3  # validate/split/encode, log+apply, the WAL fsync
    buf.insert(group_table(1))
    in_flight, outcome = [], []

    def insert_held_back():
        try:
            buf.insert(group_table(2), None, 0.6)
        except RateLimitedError as exc:
            outcome.append(exc)

    blocked = threading.Thread(target=insert_held_back)
    blocked.start()  # waits for samples in the rate limiter
    for _ in range(5):
        time.sleep(0.08)
        in_flight.append(gate._started - gate._finished)
    blocked.join()
    assert len(outcome) == 1 and in_flight == [0] * 5  # held back, yet a snapshot step would not wait for it
    buf.close()
