"""kill -9 a real replay server at random points and at named phases; every acknowledged trajectory
must be present exactly once after the restart.

Each trial starts ``services.replay_main`` (a subprocess, never a fork: the test process uses gRPC)
on the same directory, lets two client threads insert 2-group batches while a third takes snapshots
(every call), samples, releases and leases prompts, and then kills the server — after a random delay,
or by arming a named fault point (``replay.faults``) inside snapshot writing or the WAL. The checker
restores the directory read-only in this process and compares trajectory ids with what the client saw
acknowledged; the next server start must report the same count.

Proving the checker can fail: with ``durability="write"`` (no fsync) a process kill loses nothing,
because written data sits in the kernel's page cache, which outlives the process (only a machine
crash or power loss drops it) — ``test_without_fsync_a_process_kill_still_loses_nothing`` shows this.
So the loss is planted instead: ``durability="buffered"`` acknowledges a record while it is still in
process memory (written every 200 ms), exactly the bug an ack-before-durable server would have, and
the checker must report missing acknowledged trajectories.
"""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time

import pytest

from services.replay_client import ReplayClient
from tests.fault.replay_proc import Inserter, ReplayProcess, churn, stored_ids

FAULT_POINTS = ["replay.snapshot.files_written", "replay.snapshot.before_rename", "replay.snapshot.after_rename",
                "replay.snapshot.before_wal_delete", "replay.wal.after_roll", "replay.wal.after_append"]


def config(durability: str, snapshots: bool = True, flush_ms: float = 1.0) -> dict:
    return {"capacity_groups": 1_000_000, "max_staleness": 1_000_000,
            "wal": {"durability": durability, "group_commit_ms": flush_ms, "segment_bytes": 131072},
            "snapshot": {"interval_s": 0.2, "wal_bytes": 524288, "keep": 2} if snapshots
            else {"interval_s": None, "wal_bytes": None}}


def one_lifetime(cfg: dict, directory, ins: Inserter, rng: random.Random, fault: str | None,
                 expect_stored: int | None) -> bool:
    """One server lifetime ended by SIGKILL; returns whether the armed fault point fired first."""
    proc = ReplayProcess(cfg, directory, fault)
    stop, workers, fired = None, [], False
    try:
        try:
            proc.wait_serving()
        except RuntimeError:
            # A snapshot is due at once when the restored one is older than interval_s, so an armed
            # snapshot fault point can fire before the server answers health checks: a kill at a
            # named phase like any other, checked the same way.
            if fault and proc.proc.returncode == -signal.SIGKILL:
                return True
            raise
        if expect_stored is not None:  # the server's own restore agrees with the read-only checker
            client = ReplayClient(proc.address)
            assert client.info().stored_trajectories == expect_stored
            client.close()
        stop, workers = ins.start(proc.address)
        workers.append(threading.Thread(target=churn, args=(proc.address, stop), daemon=True))
        workers[-1].start()
        if fault:
            try:
                proc.proc.wait(timeout=rng.uniform(0.4, 1.2))  # dies at the fault point, or is killed
                fired = True
            except subprocess.TimeoutExpired:
                pass
        else:
            time.sleep(rng.uniform(0.05, 0.6))
    finally:
        proc.kill()
        if stop is not None:
            stop.set()
        for w in workers:
            w.join(timeout=20)
    return fired


def run_trials(tmp_path, cfg: dict, trials: int, seed: int, fault_share: float = 0.0) -> list[dict]:
    rng, directory, ins = random.Random(seed), tmp_path / "replay", Inserter()
    results, stored = [], None
    for trial in range(trials):
        fault = f"{rng.choice(FAULT_POINTS)}#{rng.randint(1, 3)}" if rng.random() < fault_share else None
        fired = one_lifetime(cfg, directory, ins, rng, fault, stored)
        ids = stored_ids(cfg, directory)
        stored = sum(ids.values())
        results.append({"trial": trial, "fault": fault, "fired": fired, "acked": len(ins.acked), "stored": stored,
                        "lost": sorted(ins.acked - ids.keys())[:5], "lost_n": len(ins.acked - ids.keys()),
                        "duplicated": [i for i, n in ids.items() if n > 1][:5],
                        "never_sent": sorted(ids.keys() - ins.sent)[:5]})
    return results


def test_acknowledged_trajectories_survive_kill_9(tmp_path):
    results = run_trials(tmp_path, config("fsync"), trials=50, seed=3, fault_share=0.4)
    bad = [r for r in results if r["lost_n"] or r["duplicated"] or r["never_sent"]]
    assert not bad, bad
    assert results[-1]["acked"] > 1000, results[-1]  # enough traffic for the check to mean something
    assert sum(r["fired"] for r in results) >= 8, [r["fault"] for r in results if r["fault"]]
    assert len(list((tmp_path / "replay" / "snapshots").glob("snap-*"))) >= 1


def test_checker_notices_loss_when_acks_precede_durability(tmp_path):
    results = run_trials(tmp_path, config("buffered", snapshots=False, flush_ms=200.0), trials=4, seed=5)
    assert any(r["lost_n"] for r in results), results
    assert not any(r["duplicated"] or r["never_sent"] for r in results), results


def test_without_fsync_a_process_kill_still_loses_nothing(tmp_path):
    results = run_trials(tmp_path, config("write"), trials=3, seed=7)
    assert not any(r["lost_n"] for r in results), results


@pytest.mark.parametrize("point", ["replay.snapshot.before_rename", "replay.snapshot.before_wal_delete"])
def test_kill_inside_snapshot_commit_then_restart_cleanly(tmp_path, point):
    cfg, ins, rng = config("fsync"), Inserter(), random.Random(11)
    assert one_lifetime(cfg, tmp_path / "replay", ins, rng, f"{point}#2", None)
    leftovers = list((tmp_path / "replay" / "snapshots").glob(".tmp-*"))
    assert bool(leftovers) == (point == "replay.snapshot.before_rename")  # died before the commit, or just after
    ids = stored_ids(cfg, tmp_path / "replay")
    assert ins.acked <= ids.keys() and max(ids.values(), default=1) == 1
    one_lifetime(cfg, tmp_path / "replay", ins, rng, None, sum(ids.values()))  # restart removes leftovers
    assert not any(p.exists() for p in leftovers)
