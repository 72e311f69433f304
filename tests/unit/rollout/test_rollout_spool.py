"""The rollout spool: durable put/ack/recover, crash leftovers, corruption quarantined by name, limits,
and the flusher against an in-process replay (retries, refusals, re-sends after a crash, late groups)."""

import asyncio
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pyarrow as pa
import pytest
from structlog.testing import capture_logs

from gyre.proto.trajectory import SCHEMA_VERSION_KEY
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.rollout.spool import Spool, SpoolCorruptError, SpoolFlusher
from tests.fakes import FakeClock, FakeReplay, FakeRpcError, OutageReplay, group_table

REPO = Path(__file__).resolve().parents[3]


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file())


def flusher_for(spool: Spool, replay) -> SpoolFlusher:
    async def insert(table):  # the worker's retry loop in miniature: ConnectionError → retry
        while True:
            try:
                return replay.insert(table)
            except ConnectionError:
                await asyncio.sleep(0.001)
    return SpoolFlusher(spool, insert)


def test_put_pending_load_ack_and_stats(tmp_path):
    clock = FakeClock(1000.0)
    spool = Spool(tmp_path, max_bytes=10**9, max_groups=100, clock=clock)
    tables = [group_table(i) for i in range(3)]
    entries = []
    for t in tables:
        entries.append(spool.put(t))
        clock.advance(2.0)
    assert [e.seq for e in spool.pending()] == [0, 1, 2]
    e0 = entries[0]
    assert e0.path.name == f"000000000000-{zlib.crc32(e0.path.read_bytes()):08x}.arrow"
    assert spool.load(entries[1]).equals(tables[1])
    spool.ack(entries[1])
    spool.ack(entries[1])  # twice: no-op
    assert [e.seq for e in spool.pending()] == [0, 2] and not entries[1].path.exists()
    stats = spool.stats()
    assert stats.pending_groups == 2
    assert stats.pending_bytes == entries[0].nbytes + entries[2].nbytes == (
        entries[0].path.stat().st_size + entries[2].path.stat().st_size)
    assert stats.oldest_age_s == 6.0 and stats.quarantined == 0


def test_recover_in_a_new_process_resumes_order_and_sequence(tmp_path):
    first = Spool(tmp_path, 10**9, 100)
    for i in range(3):
        first.put(group_table(i))
    first.ack(first.pending()[0])
    again = Spool(tmp_path, 10**9, 100)
    recovered = again.recover()
    assert [e.seq for e in recovered] == [1, 2]
    assert [again.load(e).column("prompt_index")[0].as_py() for e in recovered] == [1, 2]
    assert again.put(group_table(9)).seq == 3  # never reuses a name


def test_recover_removes_temp_file_of_an_interrupted_put(tmp_path):
    spool = Spool(tmp_path, 10**9, 100)
    good = spool.put(group_table(0))
    (tmp_path / ".tmp-000000000001.arrow").write_bytes(good.path.read_bytes()[:100])
    with capture_logs() as logs:
        recovered = Spool(tmp_path, 10**9, 100).recover()
    assert [e.seq for e in recovered] == [0]
    assert names(tmp_path) == [good.path.name]
    assert [(x["event"], Path(x["file"]).name) for x in logs] == [("spool_temp_removed", ".tmp-000000000001.arrow")]


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "bad_schema_version", "foreign_file"])
def test_corrupt_file_is_quarantined_by_name_never_loaded(tmp_path, damage):
    spool = Spool(tmp_path, 10**9, 100)
    keep, bad = spool.put(group_table(0)), spool.put(group_table(1))
    data = bad.path.read_bytes()
    if damage == "truncate":
        bad.path.write_bytes(data[: len(data) // 2])
    elif damage == "flip_byte":
        bad.path.write_bytes(data[:200] + bytes([data[200] ^ 0x01]) + data[201:])
    elif damage in ("bad_schema_version", "foreign_file"):
        table = group_table(1)
        table = table.replace_schema_metadata({SCHEMA_VERSION_KEY: b"99"})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        payload = sink.getvalue().to_pybytes()
        bad.path.unlink()
        name = f"{bad.seq:012d}-{zlib.crc32(payload):08x}.arrow" if damage == "bad_schema_version" else "notes.arrow"
        bad = bad.__class__(bad.seq, tmp_path / name, len(payload), zlib.crc32(payload), 0.0)
        bad.path.write_bytes(payload)
    with pytest.raises(SpoolCorruptError, match=bad.path.name):
        spool.load(bad)
    with capture_logs() as logs:
        recovered = Spool(tmp_path, 10**9, 100).recover()
    assert [e.seq for e in recovered] == [keep.seq]
    assert names(tmp_path / "quarantine") == [bad.path.name] and not bad.path.exists()
    (log,) = [x for x in logs if x["event"] == "spool_quarantined"]
    assert Path(log["file"]) == bad.path and log["log_level"] == "error"
    expected = {"truncate": "crc32", "flip_byte": "crc32", "bad_schema_version": "schema version 99",
                "foreign_file": "unrecognised name"}[damage]
    assert expected in log["reason"] and bad.path.name in log["reason"]


def test_limits_report_full_by_groups_and_by_bytes(tmp_path):
    by_groups = Spool(tmp_path / "g", max_bytes=10**9, max_groups=2)
    by_groups.put(group_table(0))
    assert not by_groups.full()
    by_groups.put(group_table(1))
    assert by_groups.full()
    by_groups.ack(by_groups.pending()[0])
    assert not by_groups.full()
    by_bytes = Spool(tmp_path / "b", max_bytes=1, max_groups=100)
    assert not by_bytes.full()
    by_bytes.put(group_table(0))
    assert by_bytes.full()
    with pytest.raises(ValueError, match=r"max_groups \(0\) must be >= 1"):
        Spool(tmp_path, max_bytes=1, max_groups=0)
    with pytest.raises(ValueError, match=r"max_bytes \(-5\) must be >= 1"):
        Spool(tmp_path, max_bytes=-5, max_groups=1)


@pytest.mark.parametrize("point,expect_entry", [("rollout.spool.before_rename", False),
                                                ("rollout.spool.after_rename", True)])
def test_crash_inside_put_leaves_either_a_temp_file_or_a_whole_entry(tmp_path, point, expect_entry):
    code = ("import sys; from gyre.rollout.spool import Spool; from tests.fakes import group_table; "
            "s = Spool(sys.argv[1], 10**9, 100); s.put(group_table(0)); s.put(group_table(1))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO,
                          env={**os.environ, "GYRE_FAULT_POINT": f"{point}#2"}, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    left = names(tmp_path)
    assert (".tmp-000000000001.arrow" in left) == (not expect_entry)
    spool = Spool(tmp_path, 10**9, 100)
    assert spool.put(group_table(2)).seq == 2  # a put before recover() never collides with a leftover
    recovered = spool.recover()
    assert [spool.load(e).column("prompt_index")[0].as_py() for e in recovered] == (
        [0, 1, 2] if expect_entry else [0, 2])
    assert not any(n.startswith(".tmp-") for n in names(tmp_path))


def test_flusher_retries_through_outage_then_acks_in_order(tmp_path):
    buf = TrajectoryBuffer(ReplayConfig())
    replay = FakeReplay(buf, fail_inserts=3)
    spool = Spool(tmp_path, 10**9, 100)
    for i in range(3):
        spool.put(group_table(i))
    assert asyncio.run(flusher_for(spool, replay).flush_once()) == 3
    assert replay.insert_calls == 6 and spool.pending() == [] and names(tmp_path) == []
    _, table = buf.sample(3, learner_version=0)
    assert table.column("prompt_index").to_pylist() == [0] * 4 + [1] * 4 + [2] * 4  # fifo: put order


def test_refused_or_corrupt_entry_is_quarantined_and_the_rest_delivered(tmp_path):
    buf = TrajectoryBuffer(ReplayConfig())
    replay = OutageReplay(buf, refuse={1: FakeRpcError("INVALID_ARGUMENT", "batch 3: bad rows")})
    spool = Spool(tmp_path, 10**9, 100)
    entries = [spool.put(group_table(i)) for i in range(4)]
    data = entries[2].path.read_bytes()
    entries[2].path.write_bytes(data[:-9])  # truncated after the put: caught at flush time
    flusher = flusher_for(spool, replay)
    with capture_logs() as logs:
        assert asyncio.run(flusher.flush_once()) == 2
    assert spool.pending() == [] and spool.stats().quarantined == 2
    assert names(tmp_path / "quarantine") == [entries[1].path.name, entries[2].path.name]
    reasons = {Path(x["file"]).name: x["reason"] for x in logs if x["event"] == "spool_quarantined"}
    assert "replay refused it: FakeRpcError: INVALID_ARGUMENT: batch 3: bad rows" in reasons[entries[1].path.name]
    assert "crc32" in reasons[entries[2].path.name]
    assert buf.info()["prompts_completed"] == 2 and replay.insert_calls == 3  # entry 2 was never sent


def test_unexpected_error_propagates_instead_of_quarantining(tmp_path):
    replay = OutageReplay(TrajectoryBuffer(ReplayConfig()), refuse={0: FakeRpcError("INTERNAL", "bug")})
    spool = Spool(tmp_path, 10**9, 100)
    spool.put(group_table(0))
    with pytest.raises(FakeRpcError, match="INTERNAL"):
        asyncio.run(flusher_for(spool, replay).flush_once())
    assert len(spool.pending()) == 1 and not (tmp_path / "quarantine").exists()


def test_crash_between_replay_ack_and_spool_ack_resends_harmlessly(tmp_path):
    buf = TrajectoryBuffer(ReplayConfig())
    spool = Spool(tmp_path, 10**9, 100)
    entry = spool.put(group_table(5))
    buf.insert(spool.load(entry))  # replay acknowledged; the process died before spool.ack
    spool = Spool(tmp_path, 10**9, 100)
    assert len(spool.recover()) == 1
    assert asyncio.run(flusher_for(spool, FakeReplay(buf)).flush_once()) == 1
    info = buf.info()
    assert (info["inserted_total"], info["duplicates_total"], info["size_groups"]) == (4, 4, 1)
    assert spool.pending() == []


@pytest.mark.parametrize("late_first", [True, False])
def test_late_spooled_group_of_a_reissued_prompt_completes_it_exactly_once(tmp_path, late_first):
    """Prompt 0 is leased to r0 (attempt 0), r0's group sits in its spool past the lease TTL, replay
    re-issues prompt 0 to r1 as attempt 1. Whichever group arrives first completes the prompt; the
    other is counted as duplicates and dropped, and the spool entry is acked either way (no loop)."""
    clock = FakeClock(100.0)
    buf = TrajectoryBuffer(ReplayConfig(prompt_lease_ttl_s=10.0), clock=clock)
    assert buf.lease_prompts("r0", 1) == [(0, 0)]
    spool = Spool(tmp_path, 10**9, 100)
    spool.put(group_table(0, attempt=0))
    clock.advance(11.0)
    assert buf.lease_prompts("r1", 1) == [(0, 1)]
    if not late_first:
        assert buf.insert(group_table(0, attempt=1)).accepted == 4
    assert asyncio.run(flusher_for(spool, FakeReplay(buf)).flush_once()) == 1
    if late_first:
        assert buf.insert(group_table(0, attempt=1)).duplicates == 4
    info = buf.info()
    assert (info["prompts_completed"], info["size_groups"], info["duplicates_total"]) == (1, 1, 4)
    _, table = buf.sample(1, learner_version=0)
    assert set(table.column("attempt").to_pylist()) == {0 if late_first else 1}
    assert spool.pending() == [] and buf.lease_prompts("r2", 1) == [(1, 0)]  # prompt 0 is never re-issued


def test_kill_at_flush_fault_point_after_replay_ack_then_resend_is_a_duplicate(tmp_path):
    """A real crash: a process with a durable in-process replay (fsync'd WAL) flushes its spool and is
    killed (SIGKILL) right after replay acknowledged the 2nd entry, before the spool ack.
    After restart both directories are reopened: the 2nd entry is re-sent and counted as duplicates."""
    replay_cfg = {"dir": str(tmp_path / "replay"), "snapshot": {"interval_s": None, "wal_bytes": None}}
    code = (
        "import asyncio, json, sys\n"
        "from gyre.replay.buffer import TrajectoryBuffer\nfrom gyre.replay.config import ReplayConfig\n"
        "from gyre.rollout.spool import Spool, SpoolFlusher\nfrom tests.fakes import group_table\n"
        "buf = TrajectoryBuffer(ReplayConfig(**json.loads(sys.argv[2])))\n"
        "spool = Spool(sys.argv[1], 10**9, 100)\n"
        "for i in range(3):\n    spool.put(group_table(i))\n"
        "async def insert(table):\n    return buf.insert(table)\n"
        "asyncio.run(SpoolFlusher(spool, insert).flush_once())\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "spool"), json.dumps(replay_cfg)], cwd=REPO,
                          env={**os.environ, "GYRE_FAULT_POINT": "rollout.spool.flush#2"}, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    buf = TrajectoryBuffer(ReplayConfig(**replay_cfg))
    spool = Spool(tmp_path / "spool", 10**9, 100)
    assert [e.seq for e in spool.recover()] == [1, 2]  # entry 0 was acked before the kill
    assert buf.info()["inserted_total"] == 8  # replay had durably stored entries 0 and 1
    assert asyncio.run(flusher_for(spool, FakeReplay(buf)).flush_once()) == 2
    info = buf.info()
    assert (info["inserted_total"], info["duplicates_total"], info["size_groups"]) == (12, 4, 3)
    assert spool.pending() == [] and names(tmp_path / "spool") == []
    buf.close()
