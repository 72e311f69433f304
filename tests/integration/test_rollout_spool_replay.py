"""A rollout worker with a spool against a real replay server process: SIGKILL replay mid-run, keep the
worker going through the outage, let the worker die too, restart replay on the same directory and port
with a new worker on the same spool, and check that every generated trajectory is stored in replay
exactly once and the spool is empty.

The worker uses the real ``ReplayClient`` and the fake engine of ``tests/fakes.py`` (slowed down so
that groups are in flight when replay dies); replay is ``python -m services.replay_main`` with an
fsync'd WAL, so whatever it acknowledged before the kill is restored. Without the spool (or with an
ack-before-durable spool) the groups finished during the outage or unacknowledged at the kill would be
missing (the groups the first worker left on disk are delivered only by the second one's recovery);
without dedup, re-sent groups would appear twice.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

from rollout.config import SamplingConfig
from rollout.tasks import TaskConfig, TaskSource
from rollout.worker import RolloutConfig, RolloutWorker
from services import grpc_common, replay_server
from services.replay_client import ReplayClient
from tests.fakes import FakeTokenizer, SlowEngine
from tests.fault.replay_proc import REPO, free_port

REPLAY = {"wal": {"durability": "fsync"}, "snapshot": {"interval_s": None, "wal_bytes": None},
          "max_staleness": 1_000_000, "capacity_groups": 1_000_000}
TASK = TaskSource(TaskConfig(params={"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"],
                                     "allow_parentheses": False, "allow_negation": False}, heldout_size=4))
GROUP_SIZE = 3


def start_replay(tmp_path: Path, port: int, log, procs: list) -> subprocess.Popen:
    cfg = tmp_path / "replay.yaml"
    cfg.write_text(yaml.safe_dump(REPLAY))
    procs.append(subprocess.Popen([sys.executable, "-m", "services.replay_main", "--config", str(cfg),
                             "--dir", str(tmp_path / "replay"), "--port", str(port)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    return procs[-1]


def wait_serving(proc: subprocess.Popen, address: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not grpc_common.check_health(address, replay_server.SERVICE_NAME, timeout_s=0.5):
        assert proc.poll() is None, f"replay exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"replay at {address} not serving after {timeout_s}s"
        time.sleep(0.05)


async def until(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def make_worker(client: ReplayClient, spool_dir: Path) -> RolloutWorker:
    config = RolloutConfig.model_construct(
        engine=None, sampling=SamplingConfig(), group_size=GROUP_SIZE, groups_in_flight=3,
        max_ready_groups=100_000, eval_max_new_tokens=8, retry_backoff_s=0.05, num_workers=1,
        spool_dir=str(spool_dir), spool_max_groups=1000, spool_max_bytes=10**9)
    return RolloutWorker("r0", config, TASK, SlowEngine(["7"], delay_s=0.3), client, FakeTokenizer(), seed=1)


async def outage_scenario(first: RolloutWorker, second: RolloutWorker, tmp_path: Path, port: int, log,
                          procs: list) -> dict:
    """Run; kill replay; the worker keeps generating into its spool for 2 s, then dies too (its task is
    cancelled: the in-process stand-in for a rollout crash); restart replay on the same directory and
    port; a second worker on the same spool recovers and flushes it, generates 6 more groups; stop; drain."""
    loop, address = asyncio.get_running_loop(), f"127.0.0.1:{port}"
    replay = start_replay(tmp_path, port, log, procs)
    await loop.run_in_executor(None, wait_serving, replay, address)
    task = asyncio.create_task(first.run())
    await until(lambda: first.flusher.delivered >= 6)
    replay.send_signal(signal.SIGKILL)
    replay.wait()
    at_kill = len(first.engine.generated)
    await asyncio.sleep(2.0)  # replay is down: groups in flight finish into the spool
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    out = {"during_outage": len(first.engine.generated) - at_kill,
           "left_by_first": len(list((tmp_path / "spool").glob("*.arrow"))), "retries_first": first.stats.insert_retries}
    replay = start_replay(tmp_path, port, log, procs)
    await loop.run_in_executor(None, wait_serving, replay, address)
    task = asyncio.create_task(second.run())
    await until(lambda: len(second.engine.generated) >= 6)
    second.stop()
    await task
    out["left"] = await second.flusher.drain(30.0)
    out["delivered_by_second"] = second.flusher.delivered
    return out


def test_replay_killed_and_restarted_loses_and_duplicates_nothing(tmp_path):
    port = free_port()
    client = ReplayClient(f"127.0.0.1:{port}", timeout_s=10.0)
    first, second = make_worker(client, tmp_path / "spool"), make_worker(client, tmp_path / "spool")
    log, procs = open(tmp_path / "replay.log", "ab"), []
    try:
        out = asyncio.run(outage_scenario(first, second, tmp_path, port, log, procs))
        print(out)
        # Generation went on while replay was down, and the first worker's spool outlived it.
        assert out["during_outage"] >= 1 and out["left_by_first"] >= out["during_outage"], out
        assert out["retries_first"] >= 1 and out["delivered_by_second"] >= out["left_by_first"], out
        assert out["left"] == 0 and list((tmp_path / "spool").glob("*.arrow")) == []
        assert not (tmp_path / "spool" / "quarantine").exists()
        generated = set()
        for request_id in first.engine.generated + second.engine.generated:
            prompt_index, attempt = request_id.split("@")[0].split("-")
            generated.update(f"{prompt_index}-{i}-{attempt}" for i in range(GROUP_SIZE))
        info = client.info()
        assert info.stored_trajectories == len(generated)
        _, table = client.sample(info.size_groups, learner_version=0, timeout_s=5.0, consumer="checker")
        stored = Counter(table.column("trajectory_id").to_pylist())
        assert set(stored) == generated and max(stored.values()) == 1
    finally:
        client.close()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
        log.close()
