"""Issue 5 (c): stop replay for a while — no trajectory lost or duplicated after it returns.

A rollout worker with a spool against a real replay server process. Outage 1: SIGKILL replay while
groups are in flight; the worker finishes them into its spool; restart replay on the same directory and
port; the same worker reconnects, delivers its spool and keeps generating. Outage 2: SIGKILL replay
again with groups in flight, then let the worker die too; restart replay; a new worker on the same
spool recovers and delivers what the first one left. Every generated trajectory must be stored in
replay exactly once and the spool must end empty.

``test_replay_outage_with_real_vllm_loses_and_duplicates_nothing`` is the issue's test: the worker
generates with the real vLLM engine (``rollout.engine.RolloutEngine`` on CPU, the tiny random Llama of
``tests/tiny_model.py`` and its real tokenizer), the real ``ReplayClient`` and the real spool; replay
is ``python -m services.replay_main`` with an fsync'd WAL, so whatever it acknowledged before the kill
is restored. Groups are long enough (``ignore_eos``, ``MAX_NEW_TOKENS``) that some are in flight when
replay dies; the outage lasts until those have finished into the spool and the flusher has failed to
deliver at least once (no fixed sleeps). ``test_replay_outage_with_fake_engine_...`` runs the same
scenario on ``tests.fakes.SlowEngine`` in a few seconds (no vLLM start).

Without the spool (or with an ack-before-durable spool) the groups finished during the outage or
unacknowledged at the kill would be missing (the groups the first worker left on disk are delivered
only by the second one's recovery); without dedup, re-sent groups would appear twice.
"""

from __future__ import annotations

import asyncio
import math
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

from rollout.config import EngineConfig, SamplingConfig
from rollout.tasks import TaskConfig, TaskSource
from rollout.worker import RolloutConfig, RolloutWorker
from services import grpc_common, replay_server
from services.replay_client import ReplayClient
from tests.fakes import FakeTokenizer, SlowEngine
from tests.fault.replay_proc import REPO, free_port

REPLAY = {"wal": {"durability": "fsync"}, "snapshot": {"interval_s": None, "wal_bytes": None},
          "max_staleness": 1_000_000, "capacity_groups": 1_000_000}
TASK_PARAMS = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"],
               "allow_parentheses": False, "allow_negation": False}
GROUP_SIZE = 3
MAX_NEW_TOKENS = 96
"""Real-engine responses (``ignore_eos``): long enough that groups are still generating when replay dies."""


class Recorder:
    """The worker's engine, unchanged, plus a record of its groups: ``in_flight`` (request ids being
    generated now) and ``generated`` (request ids ``"{group_id}@{rollout_id}"`` of finished groups)."""

    def __init__(self, engine) -> None:
        self.engine, self.in_flight, self.generated = engine, set(), []

    @property
    def version(self) -> int:
        return self.engine.version

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def generate(self, prompt_token_ids, n, sampling, request_id, seed=None):
        self.in_flight.add(request_id)
        try:
            out = await self.engine.generate(prompt_token_ids, n, sampling, request_id, seed)
        finally:
            self.in_flight.discard(request_id)
        self.generated.append(request_id)
        return out


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


async def until(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not reached in {timeout_s}s: {what}"
        await asyncio.sleep(0.02)


def make_worker(client: ReplayClient, spool_dir: Path, engine, tokenizer, sampling: SamplingConfig) -> RolloutWorker:
    config = RolloutConfig.model_construct(
        engine=None, sampling=sampling, group_size=GROUP_SIZE, groups_in_flight=3,
        max_ready_groups=100_000, eval_max_new_tokens=8, retry_backoff_s=0.05, num_workers=1,
        spool_dir=str(spool_dir), spool_max_groups=1000, spool_max_bytes=10**9)
    task = TaskSource(TaskConfig(params=TASK_PARAMS, heldout_size=4))
    return RolloutWorker("r0", config, task, Recorder(engine), client, tokenizer, seed=1)


async def kill_while_generating(replay: subprocess.Popen, worker: RolloutWorker) -> dict:
    """SIGKILL replay while ``worker`` has groups in flight; return once those groups are in its spool and
    its flusher has failed to deliver at least once (replay is still down then)."""
    await until(lambda: worker.engine.in_flight, "a group in flight")
    replay.send_signal(signal.SIGKILL)
    replay.wait()
    at_kill, in_flight, retries = len(worker.engine.generated), set(worker.engine.in_flight), worker.stats.insert_retries
    await until(lambda: in_flight <= set(worker.engine.generated) and worker.stats.groups >= len(worker.engine.generated)
                and worker.stats.insert_retries > retries, "groups in flight at the kill spooled, an insert retried")
    return {"in_flight_at_kill": len(in_flight), "during_outage": len(worker.engine.generated) - at_kill}


async def outage_scenario(first: RolloutWorker, second: RolloutWorker, tmp_path: Path, port: int, log,
                          procs: list) -> dict:
    """Two outages. 1: kill replay with groups in flight, the worker spools them; restart replay on the same
    directory and port; the same worker reconnects, delivers its spool and keeps generating. 2: kill replay
    again, the worker spools its groups in flight, then dies too (its task is cancelled: the in-process
    stand-in for a rollout crash); restart replay; a second worker on the same spool recovers and flushes
    it, generates 6 more groups; stop; drain."""
    loop, address = asyncio.get_running_loop(), f"127.0.0.1:{port}"

    async def restart_replay() -> subprocess.Popen:
        replay = start_replay(tmp_path, port, log, procs)
        await loop.run_in_executor(None, wait_serving, replay, address)
        return replay
    replay = await restart_replay()
    task = asyncio.create_task(first.run())
    await until(lambda: first.flusher.delivered >= 6, "6 groups delivered")
    out = {"first": await kill_while_generating(replay, first)}
    replay, generated = await restart_replay(), len(first.engine.generated)
    await until(lambda: first.flusher.delivered >= generated and len(first.engine.generated) >= generated + 3,
                "the live worker delivered its spool after replay returned and kept generating")
    out["second"] = await kill_while_generating(replay, first)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    out.update(left_by_first=len(list((tmp_path / "spool").glob("*.arrow"))), retries_first=first.stats.insert_retries)
    await restart_replay()
    task = asyncio.create_task(second.run())
    await until(lambda: len(second.engine.generated) >= 6, "6 groups generated by the second worker")
    second.stop()
    await task
    out["left"] = await second.flusher.drain(30.0)
    out["delivered_by_second"] = second.flusher.delivered
    return out


def check_exactly_once(out: dict, first: RolloutWorker, second: RolloutWorker, client: ReplayClient,
                       spool: Path):
    """Assert the outage's invariants; return the table of every stored trajectory."""
    # Generation went on while replay was down (both times), and the first worker's spool outlived it.
    for outage in (out["first"], out["second"]):
        assert outage["during_outage"] >= outage["in_flight_at_kill"] >= 1, out
    assert out["left_by_first"] >= out["second"]["during_outage"], out
    assert out["retries_first"] >= 2 and out["delivered_by_second"] >= out["left_by_first"], out
    assert out["left"] == 0 and list(spool.glob("*.arrow")) == []
    assert not (spool / "quarantine").exists()
    generated = set()
    for request_id in first.engine.generated + second.engine.generated:
        prompt_index, attempt = request_id.split("@")[0].split("-")
        generated.update(f"{prompt_index}-{i}-{attempt}" for i in range(GROUP_SIZE))
    info = client.info()
    assert info.stored_trajectories == len(generated)
    _, table = client.sample(info.size_groups, learner_version=0, timeout_s=5.0, consumer="checker")
    stored = Counter(table.column("trajectory_id").to_pylist())
    assert set(stored) == generated and max(stored.values()) == 1
    return table


async def with_engine(start_engine, scenario):
    """Start the engine on this event loop (vLLM's client is bound to it), run ``scenario(engine)``, shut down."""
    engine = await start_engine()
    try:
        return await scenario(engine)
    finally:
        if hasattr(engine, "shutdown"):  # the fake engine has no processes to stop
            await engine.shutdown()


def run_outage(tmp_path: Path, start_engine, tokenizer, sampling: SamplingConfig):
    """The whole outage scenario on the engine ``start_engine()`` makes; returns the stored trajectories."""
    port = free_port()
    client = ReplayClient(f"127.0.0.1:{port}", timeout_s=10.0)
    log, procs, workers = open(tmp_path / "replay.log", "ab"), [], []

    async def scenario(engine):
        workers.extend(make_worker(client, tmp_path / "spool", engine, tokenizer, sampling) for _ in range(2))
        return await outage_scenario(*workers, tmp_path, port, log, procs)
    try:
        out = asyncio.run(with_engine(start_engine, scenario))
        print(out)
        return check_exactly_once(out, *workers, client, tmp_path / "spool")
    finally:
        client.close()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
        log.close()


def test_replay_outage_with_real_vllm_loses_and_duplicates_nothing(tmp_path, tiny_llama):
    from transformers import AutoTokenizer

    from rollout.engine import RolloutEngine

    config = EngineConfig(model=str(tiny_llama), kv_cache_gib=0.25, max_model_len=1024)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    table = run_outage(tmp_path, lambda: RolloutEngine.start(config, initial_version=0),
                       AutoTokenizer.from_pretrained(tiny_llama), sampling)
    # What was stored is what vLLM sampled: full-length responses, aligned finite behaviour logprobs.
    for tokens, logprobs, starts, versions in zip(*(table.column(c).to_pylist() for c in (
            "response_token_ids", "behaviour_logprobs", "version_span_starts", "version_span_versions"))):
        assert len(tokens) == len(logprobs) == MAX_NEW_TOKENS
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs)
        assert (starts, versions) == ([0], [0])


def test_replay_outage_with_fake_engine_loses_and_duplicates_nothing(tmp_path):
    async def start_fake():
        return SlowEngine(["7"], delay_s=0.3)
    run_outage(tmp_path, start_fake, FakeTokenizer(), SamplingConfig())
