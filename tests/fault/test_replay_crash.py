"""kill -9 a real replay server at random points and at named phases; every acknowledged trajectory
must be present exactly once after the restart.

Each trial starts ``services.replay.main`` (a subprocess, never a fork: the test process uses gRPC)
on the same directory, lets two client threads insert 2-group batches while a third takes snapshots
(every call), samples, releases and leases prompts, and then kills the server — after a random delay,
or by arming a named fault point (``replay.faults``) inside snapshot writing or the WAL. The checker
restores the directory read-only in this process and compares trajectory ids with what the client saw
acknowledged; the next server start must report the same count. A lifetime with a fault point armed must
end in that point's SIGKILL (exit status ``-SIGKILL``, within ``FIRE_TIMEOUT_S``): a point never reached, or a
server dying some other way, fails the trial, so the test counts exactly the kills it armed. A lifetime without
one must still be running when the test kills it.

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

from gyre.services.common.replay_client import ReplayClient
from tests.fault.replay_proc import Inserter, ReplayProcess, churn, stored_ids

FAULT_POINTS = ["replay.snapshot.files_written", "replay.snapshot.before_rename", "replay.snapshot.after_rename",
                "replay.snapshot.before_wal_delete", "replay.wal.after_roll", "replay.wal.after_append"]


def config(durability: str, snapshots: bool = True, flush_ms: float = 1.0) -> dict:
    return {"capacity_groups": 1_000_000, "max_staleness": 1_000_000,
            "wal": {"durability": durability, "group_commit_ms": flush_ms, "segment_bytes": 131072},
            "snapshot": {"interval_s": 0.2, "wal_bytes": 524288, "keep": 2} if snapshots
            else {"interval_s": None, "wal_bytes": None}}


FIRE_TIMEOUT_S = 60.0
"""How long an armed fault point has to fire (each is reached within a second or two of traffic)."""


def ended(proc: ReplayProcess) -> str:
    """How ``proc`` ended so far: ``"running"``, ``"fired"`` (SIGKILL: only a fault point sends it before the
    test does) or ``"exit <code>"`` (it died some other way)."""
    code = proc.proc.poll()
    return "running" if code is None else "fired" if code == -signal.SIGKILL else f"exit {code} (see {proc.log.name})"


def one_lifetime(cfg: dict, directory, ins: Inserter, rng: random.Random, fault: str | None,
                 expect_stored: int | None) -> str:
    """One server lifetime ended by SIGKILL: with ``fault`` armed, waits (``FIRE_TIMEOUT_S`` at most) for the
    server to die at it; without, kills it after a random delay. Returns how it ended before the test's own kill
    (``ended``): ``"fired"`` is the armed fault point's SIGKILL, ``"running"`` means the test killed it."""
    proc = ReplayProcess(cfg, directory, fault)
    stop, workers = None, []
    try:
        try:
            proc.wait_serving()
        except RuntimeError:
            # A snapshot is due at once when the restored one is older than interval_s, so an armed
            # snapshot fault point can fire before the server answers health checks: a kill at a
            # named phase like any other, checked the same way.
            return ended(proc)
        if expect_stored is not None:  # the server's own restore agrees with the read-only checker
            client = ReplayClient(proc.address)
            assert client.info().stored_trajectories == expect_stored
            client.close()
        stop, workers = ins.start(proc.address)
        workers.append(threading.Thread(target=churn, args=(proc.address, stop), daemon=True))
        workers[-1].start()
        if fault:
            try:
                proc.proc.wait(timeout=FIRE_TIMEOUT_S)  # dies at the fault point
            except subprocess.TimeoutExpired:
                pass
        else:
            # First let one batch be acknowledged: a slow first call (a cold import, a loaded machine) must not
            # use up the random window, or no lifetime acknowledges anything and the checker checks nothing.
            acked_before, deadline = len(ins.acked), time.monotonic() + 30.0
            while len(ins.acked) == acked_before and time.monotonic() < deadline and proc.proc.poll() is None:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.05, 0.6))
        return ended(proc)
    finally:
        proc.kill()
        if stop is not None:
            stop.set()
        for w in workers:
            w.join(timeout=20)


def run_trials(tmp_path, cfg: dict, trials: int, seed: int, fault_share: float = 0.0) -> list[dict]:
    """``trials`` server lifetimes on one directory; each armed fault must fire, every other lifetime must last
    until the test kills it. Returns one row per trial: what was acknowledged, stored, lost or duplicated."""
    rng, directory, ins = random.Random(seed), tmp_path / "replay", Inserter()
    results, stored = [], None
    for trial in range(trials):
        fault = f"{rng.choice(FAULT_POINTS)}#{rng.randint(1, 3)}" if rng.random() < fault_share else None
        how = one_lifetime(cfg, directory, ins, rng, fault, stored)
        assert how == ("fired" if fault else "running"), f"trial {trial}, fault {fault}: {how}"
        ids = stored_ids(cfg, directory)
        stored = sum(ids.values())
        results.append({"trial": trial, "fault": fault, "fired": how == "fired", "acked": len(ins.acked),
                        "stored": stored, "lost": sorted(ins.acked - ids.keys())[:5],
                        "lost_n": len(ins.acked - ids.keys()), "duplicated": [i for i, n in ids.items() if n > 1][:5],
                        "never_sent": sorted(ids.keys() - ins.sent)[:5]})
    return results


@pytest.mark.slow  # 50 replay processes killed (~1 min): `make test`, not `make test-fast`
def test_acknowledged_trajectories_survive_kill_9(tmp_path):
    results = run_trials(tmp_path, config("fsync"), trials=50, seed=3, fault_share=0.4)
    bad = [r for r in results if r["lost_n"] or r["duplicated"] or r["never_sent"]]
    assert not bad, bad
    assert results[-1]["acked"] > 1000, results[-1]  # enough traffic for the check to mean something
    armed = [r["fault"] for r in results if r["fault"]]
    assert len(armed) >= 8 and sum(r["fired"] for r in results) == len(armed), armed
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
    assert one_lifetime(cfg, tmp_path / "replay", ins, rng, f"{point}#2", None) == "fired"
    leftovers = list((tmp_path / "replay" / "snapshots").glob(".tmp-*"))
    assert bool(leftovers) == (point == "replay.snapshot.before_rename")  # died before the commit, or just after
    ids = stored_ids(cfg, tmp_path / "replay")
    assert ins.acked <= ids.keys() and max(ids.values(), default=1) == 1
    # restart removes leftovers
    assert one_lifetime(cfg, tmp_path / "replay", ins, rng, None, sum(ids.values())) == "running"
    assert not any(p.exists() for p in leftovers)
