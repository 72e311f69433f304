"""``bench.replay``'s snapshot rate: each snapshot's MB/s is the bytes that snapshot wrote ÷ its time (a
real replay service in its own process, as the bench runs it)."""

import pytest

from bench.replay import GROUPS, SnapshotRound, replay_config, snapshot_rates, snapshot_rounds
from bench.replay_parts import Server, requests, snapshot_bytes, stream
from gyre.services.common.replay_client import ReplayClient


def test_snapshot_rounds_measure_the_bytes_each_snapshot_wrote(tmp_path):
    server = Server("replay", tmp_path / "main", replay_config("fsync"))
    client = ReplayClient(server.address)
    try:
        stream(server.address, requests(0, 2, GROUPS, seed=1))
        rounds, next_prompt = snapshot_rounds(server, client, tmp_path, 2 * GROUPS)
        newest = max((tmp_path / "main" / "snapshots").glob("snap-*"))
        files = [f for f in newest.rglob("*") if f.is_file()]
    finally:
        client.close()
        server.stop()
    assert next_prompt == 5 * GROUPS
    assert {f.name for f in files} >= {"trajectories.arrow", "groups.arrow", "state.json", "manifest.json"}
    sizes = [r.nbytes for r in rounds]
    assert sizes[-1] == sum(f.stat().st_size for f in files)  # the newest snapshot's own files
    # Each round inserts one more batch before its snapshot, and a snapshot holds the whole buffer: the
    # bytes grow by about a batch (~0.5 MB of Arrow) a round, a figure taken once would not.
    growth = [b - a for a, b in zip(sizes, sizes[1:])]
    assert all(0.8 * growth[0] < g < 1.2 * growth[0] for g in growth) and growth[0] > 300_000, sizes
    assert all(r.seconds > 0 and r.sequential_mb_s > 0 for r in rounds)


def test_snapshot_rates_divide_each_rounds_bytes_by_its_own_time():
    rounds = [SnapshotRound(100_000_000, 0.5, 400.0), SnapshotRound(300_000_000, 1.0, 100.0),
              SnapshotRound(250_000_000, 2.0, 300.0)]
    # per round 200, 300 and 125 MB/s: median 200 (median bytes ÷ median time would say 250); baseline 300
    assert snapshot_rates(rounds) == {"snapshot_gb": 0.25, "snapshot_s": 1.0, "snapshot_mb_s": 200.0,
                                      "sequential_write_mb_s": 300.0, "snapshot_ratio": 0.667}


def test_snapshot_bytes_of_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no snapshot directory at"):
        snapshot_bytes(tmp_path / "snap-1")
