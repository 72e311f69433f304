"""WAL and snapshot round trips: restore gives the same contents, counts, leases, ledger and limiter."""

import random
import shutil
import threading

import pyarrow as pa
import pytest

from gyre.replay import snapshot as snapshot_mod
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig, WalConfig
from gyre.replay.records import Record, encode
from gyre.replay.wal import Wal, WalError
from gyre.replay.wal_read import list_segments, read_segment
from tests.fakes import FakeClock, group_table

NO_AUTO = {"interval_s": None, "wal_bytes": None}


def config(tmp_path, **kw):
    return ReplayConfig(dir=str(tmp_path), seed=0, snapshot=kw.pop("snapshot", NO_AUTO), **kw)


def test_wal_round_trip_rolls_segments_with_contiguous_lsns(tmp_path):
    wal = Wal(tmp_path, WalConfig(segment_bytes=4096), next_lsn=0)
    records = [Record("insert", {}, bytes(range(256)) * 8) if i % 3 == 0 else Record("ack", {"lease_ids": [str(i)]})
               for i in range(60)]
    for r in records:
        wal.wait(wal.append([encode(r)]))
    wal.close()
    got, expected = [], 0
    for path in list_segments(tmp_path):
        scan = read_segment(path)
        assert scan.error is None and scan.first_lsn == expected
        got += scan.records
        expected += len(scan.records)
    assert len(list_segments(tmp_path)) > 3
    assert [(r.kind, r.meta, bytes(r.payload)) for r in got] == [(r.kind, r.meta, r.payload) for r in records]


def test_wal_mixing_zstd_and_plain_inserts_restores_the_same_contents(tmp_path):
    buf = TrajectoryBuffer(config(tmp_path, wal={"compression": "zstd"}))
    buf.insert(group_table(0))
    buf.close()
    buf = TrajectoryBuffer(config(tmp_path))  # default: payloads appended uncompressed
    buf.insert(group_table(1))
    buf.close()
    sizes = [len(encode(Record("insert", {}, bytes(4096)), c)) for c in ("zstd", "none")]
    assert sizes[0] < sizes[1]  # the option really compresses
    restored = TrajectoryBuffer(config(tmp_path))
    assert restored.info()["stored_trajectories"] == 2 * group_table(0).num_rows
    assert sorted(g.group_id for g in restored.state.store.groups.values()) == ["0-0", "1-0"]
    restored.close()


def test_group_commit_shares_fsyncs_between_concurrent_appends(tmp_path):
    wal = Wal(tmp_path, WalConfig(group_commit_ms=200.0), next_lsn=0)
    record = encode(Record("ack", {"lease_ids": ["x"]}))
    rounds, threads = 5, 8
    barrier = threading.Barrier(threads)

    def worker():
        for _ in range(rounds):
            barrier.wait()
            wal.wait(wal.append([record]))  # all 8 append within the 200 ms window

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert wal.next_lsn == rounds * threads and wal.fsyncs <= 2 * rounds, wal.fsyncs
    wal.close()


def random_history(buf, clock, rng, steps=120):
    leases, prompt = [], 0
    for _ in range(steps):
        op = rng.random()
        leases = [x for x in leases if x in buf.state.leases]  # some expired
        if op < 0.35:
            buf.insert(pa.concat_tables([group_table(prompt + i, version=rng.randrange(3))
                                         for i in range(rng.randrange(1, 3))]))
            prompt += 2
        elif op < 0.55 and (got := buf.sample(rng.randrange(1, 3), rng.randrange(3), consumer="L")):
            leases.append(got[0])
        elif op < 0.65 and leases:
            buf.ack([leases.pop(rng.randrange(len(leases)))])
        elif op < 0.72 and leases:
            buf.release([leases.pop()])
        elif op < 0.8:
            buf.lease_prompts("r", rng.randrange(3))
        elif op < 0.85:
            buf.update_priorities([f"{rng.randrange(prompt + 1)}-0"], [rng.random()])
        elif op < 0.9:
            clock.advance(rng.choice([1.0, 30.0]))
        elif op < 0.95:
            buf.snapshot()
    return leases


def contents(buf):
    groups = {k: (g.group_id, g.state, g.times_sampled, g.priority, g.table.to_pylist())
              for k, g in buf.state.store.groups.items()}
    return buf.state.state_dict(), groups


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_restore_after_crash_equals_the_state_before(tmp_path, seed):
    clock, rng = FakeClock(1000.0), random.Random(seed)
    cfg = config(tmp_path / "live", selector="prioritized", capacity_groups=12, lease_ttl_s=20, max_staleness=1,
                 max_times_sampled=2, rate_limiter={"samples_per_insert": 2.0, "error_buffer": 100.0},
                 wal={"segment_bytes": 16384})
    buf = TrajectoryBuffer(cfg, clock=clock)
    leases = random_history(buf, clock, rng)
    before = contents(buf)
    shutil.copytree(tmp_path / "live", tmp_path / "crashed")  # a kill -9 image: written, not closed
    restored = TrajectoryBuffer(cfg.model_copy(update={"dir": str(tmp_path / "crashed")}), clock=clock)
    assert contents(restored) == before
    if leases:  # an outstanding lease survives the restart and can be acked there
        assert restored.ack([leases[0]]) >= 1
    restored.close()
    buf.close()


def test_snapshots_keep_two_and_delete_covered_wal(tmp_path):
    cfg = config(tmp_path, wal={"segment_bytes": 4096})
    buf = TrajectoryBuffer(cfg)
    for round_ in range(3):
        for i in range(6):
            buf.insert(group_table(round_ * 10 + i))
        buf.snapshot()
    snaps = snapshot_mod.list_snapshots(tmp_path / "snapshots")
    assert len(snaps) == 2
    oldest = int(snaps[-1].name[5:])
    segments = list_segments(tmp_path / "wal")
    assert int(segments[0].name[:20]) <= oldest and int(segments[1].name[:20]) > oldest
    before = contents(buf)
    buf.close()
    shutil.rmtree(snaps[0])  # without the newest snapshot the older one + WAL still restore everything
    again = TrajectoryBuffer(cfg)
    assert contents(again) == before
    again.close()


def test_snapshot_does_not_block_inserts_and_samples(tmp_path, monkeypatch):
    """Inserts, a sample and an ack all finish while the snapshot is held inside its write: the write waits
    for the test to release it, and would instead time out (30 s) if they waited for the snapshot."""
    buf = TrajectoryBuffer(config(tmp_path))
    for i in range(20):
        buf.insert(group_table(i))
    real = snapshot_mod._write_arrow
    writing, release, timed_out = threading.Event(), threading.Event(), []

    def held(*args, **kw):
        writing.set()
        timed_out.append(not release.wait(30.0))
        return real(*args, **kw)

    monkeypatch.setattr(snapshot_mod, "_write_arrow", held)
    snap = threading.Thread(target=buf.snapshot)
    snap.start()
    assert writing.wait(30.0), "the snapshot never reached its write"
    for i in range(20, 30):
        buf.insert(group_table(i))
    lease, _ = buf.sample(2, 0)
    buf.ack([lease])
    assert snap.is_alive() and timed_out == [], f"the foreground waited for the snapshot (timed out: {timed_out})"
    release.set()
    snap.join()
    assert timed_out == [False, False]  # one wait per file, both released
    buf.close()
    again = TrajectoryBuffer(config(tmp_path))
    assert again.info()["stored_groups"] == 28
    again.close()


def test_failed_fsync_fails_the_log_for_good(tmp_path, monkeypatch):
    buf = TrajectoryBuffer(config(tmp_path))
    buf.insert(group_table(0))
    import gyre.replay.wal as wal_mod

    def broken(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(wal_mod.os, "fsync", broken)
    with pytest.raises(WalError, match="Input/output error"):
        buf.insert(group_table(1))
    monkeypatch.undo()
    with pytest.raises(WalError):
        buf.insert(group_table(2))
    buf.close()
