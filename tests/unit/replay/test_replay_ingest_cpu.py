"""The insert path's CPU savings keep behaviour: WAL records written as Arrow's own pieces (the payload
not copied, one writev), whole-schema validation first, the malloc tuning, and snapshot steps that
pause while inserts are in flight."""

import ctypes
import os

import numpy as np
import pyarrow as pa
import pytest

from gyre.proto.trajectory import SchemaError, validate_table
from gyre.replay import files as files_mod
from gyre.replay import memory
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig, WalConfig
from gyre.replay.files import ForegroundGate
from gyre.replay.records import Record, encode, encode_parts
from gyre.replay.wal import Wal
from gyre.replay.wal_read import read_segment
from tests.fakes import group_table

NO_AUTO = {"interval_s": None, "wal_bytes": None}


# ---- WAL records as pieces ----------------------------------------------------------------------------
def test_encode_parts_hand_the_payload_over_uncopied_and_join_to_the_record():
    payload = pa.py_buffer(np.random.default_rng(0).integers(0, 256, 300_001, np.uint8).tobytes())
    rec = Record("insert", {"n": 1}, payload)
    parts = encode_parts(rec)
    assert [p for p in parts if isinstance(p, pa.Buffer) and p.address == payload.address] != []
    assert b"".join(bytes(memoryview(p)) for p in parts) == encode(rec).to_pybytes()
    assert sum(memoryview(p).nbytes for p in parts) == encode(rec).size


@pytest.mark.parametrize("durability", ["fsync", "buffered"])
def test_records_appended_as_pieces_read_back_even_when_writev_writes_a_few_bytes_at_a_time(
        tmp_path, monkeypatch, durability):
    real = os.writev
    calls = []
    monkeypatch.setattr("gyre.replay.wal.os.writev",
                        lambda fd, bufs: calls.append(len(bufs)) or real(fd, [bytes(memoryview(bufs[0])[:7])]))
    records = [Record("insert", {}, pa.py_buffer(bytes(range(256)) * 40)), Record("ack", {"lease_ids": ["a"]}),
               Record("insert", {}, pa.py_buffer(b"x" * 1001))]
    wal = Wal(tmp_path, WalConfig(durability=durability), next_lsn=5)
    lsn = wal.append([encode_parts(records[0])])
    lsn = wal.append([encode_parts(records[1]), encode_parts(records[2])])
    wal.wait(lsn)
    wal.close()
    assert lsn == 7 and calls and max(calls) > 1  # several pieces per writev, short writes resumed
    scan = read_segment(wal.segments()[0])
    assert scan.error is None
    assert [(r.kind, r.meta, bytes(r.payload)) for r in scan.records] == \
        [(r.kind, r.meta, bytes(r.payload)) for r in records]
    assert wal.bytes_written == sum(encode(r).size for r in records)


# ---- validation -----------------------------------------------------------------------------------------
def test_a_table_with_the_exact_schema_skips_the_field_by_field_check(monkeypatch):
    table = group_table(0)
    monkeypatch.setattr("gyre.proto.trajectory._check_columns",
                        lambda t: (_ for _ in ()).throw(AssertionError("field-by-field check ran")))
    validate_table(table)
    with pytest.raises(AssertionError, match="field-by-field"):
        validate_table(table.replace_schema_metadata({}))  # differs: checked field by field


def test_row_checks_over_several_chunks_name_the_row_of_the_whole_table():
    good, bad = group_table(0), group_table(1)
    lp = bad.column("behaviour_logprobs").combine_chunks()
    rows = lp.to_pylist()
    rows[2] = rows[2][:-1]
    bad = bad.set_column(bad.schema.get_field_index("behaviour_logprobs"), bad.schema.field("behaviour_logprobs"),
                         pa.array(rows, lp.type))
    table = pa.concat_tables([good, bad])
    assert table.column("behaviour_logprobs").num_chunks == 2
    n = len(rows[2]) + 1
    with pytest.raises(SchemaError, match=rf"row {good.num_rows + 2} \(1-2-0\): response_token_ids has {n} tokens "
                                          rf"but behaviour_logprobs has {n - 1}"):
        validate_table(table)


def test_nulls_in_a_column_are_named_on_the_fast_path():
    table = group_table(0)
    i = table.schema.get_field_index("reward")
    rewards = pa.array([None] + table.column("reward").to_pylist()[1:], pa.float32())
    table = table.set_column(i, table.schema.field(i), rewards)
    assert table.schema.equals(group_table(0).schema, check_metadata=True)
    with pytest.raises(SchemaError, match="column 'reward' has 1 null values"):
        validate_table(table)


# ---- malloc tuning ---------------------------------------------------------------------------------------
def test_tune_malloc_sets_the_three_glibc_knobs(monkeypatch):
    calls = []

    class Libc:
        class mallopt:  # noqa: N801 - stands in for a ctypes function
            argtypes = restype = None

            def __new__(cls, param, value):
                calls.append((param, value))
                return 1

    monkeypatch.setattr(memory.ctypes, "CDLL", lambda name: Libc)
    assert memory.tune_malloc() is True
    assert calls == [(-3, 32 << 20), (-1, (1 << 31) - 1), (-8, 1)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_ARENA_MAX


def test_tune_malloc_changes_nothing_without_mallopt(monkeypatch):
    monkeypatch.setattr(memory.ctypes, "CDLL", lambda name: object())
    assert memory.tune_malloc() is False


def test_tune_malloc_works_on_this_glibc():
    assert hasattr(ctypes.CDLL(None), "mallopt")  # the CI image is glibc Linux
    assert memory.tune_malloc() is True


# ---- snapshot steps pause while the server is busy -------------------------------------------------------
def test_a_background_step_pauses_only_after_recent_foreground_work(monkeypatch):
    slept = []
    monkeypatch.setattr(files_mod.time, "sleep", slept.append)
    gate = ForegroundGate(pause_s=0.25, busy_s=3600)
    gate.wait_turn()
    assert slept == []  # no foreground work yet: full speed
    with gate.urgent():
        pass
    gate.wait_turn()
    gate.wait_turn()
    assert slept == [0.25, 0.25]  # busy: every step pauses
    idle = ForegroundGate(pause_s=0.25, busy_s=0.0)
    with idle.urgent():
        pass
    idle.wait_turn()
    assert slept == [0.25, 0.25]  # the work was not recent enough
    never = ForegroundGate(pause_s=0.0, busy_s=3600)
    with never.urgent():
        pass
    never.wait_turn()
    assert slept == [0.25, 0.25]


def test_the_buffer_gate_pauses_as_configured(tmp_path):
    buf = TrajectoryBuffer(ReplayConfig(dir=str(tmp_path), snapshot={**NO_AUTO, "busy_pause_ms": 2.5}))
    assert buf.durability.foreground.pause_s == 0.0025
    buf.close()
    with pytest.raises(ValueError, match="busy_pause_ms"):
        ReplayConfig(snapshot={"busy_pause_ms": -1})
