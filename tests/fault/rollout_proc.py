"""Crash-test harness: a rollout worker with a spool in a process of its own (``python -m tests.fault.rollout_proc``),
which a test can SIGKILL, and the append-only event log through which the test follows it.

The worker is the real ``RolloutWorker`` with the real ``Spool``, ``SpoolFlusher`` and ``ReplayClient``; its
engine is ``tests.fakes.SlowEngine`` (``--engine fake``) or the real vLLM ``RolloutEngine`` on CPU
(``--engine vllm --model DIR``). The process is started with ``subprocess`` (exec, never a fork: the test process
uses gRPC) in a session of its own, so ``WorkerProcess.kill`` SIGKILLs it with any engine processes of its own.

Event log (``--events FILE``, one ``os.write`` per line on an ``O_APPEND`` descriptor, so a SIGKILL leaves only
whole lines, and every line written before the kill is there — the page cache outlives the process)::

    start <request_id>   the engine began generating a group (request id ``"{group_id}@{rollout_id}"``)
    gen <request_id>     it finished generating it
    drop <request_id>    its generation was cancelled (clean stop)
    done <group_id>      the worker counted the group as delivered (``RolloutWorker._deliver`` returned: with a
                         spool, the group must be durable in it from then on)
    retry                an insert into replay failed with ``ConnectionError`` (replay down)
    acked <file name>    replay acknowledged a spooled group and the spool deleted its file
    left <n>             clean exit (``--stop-after``): groups still in the spool after the final drain
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.fault.replay_proc import REPO

GROUP_SIZE = 3
MAX_NEW_TOKENS = 96
"""Real-engine responses (``ignore_eos``): long enough that groups are still generating when replay dies."""
TASK_PARAMS = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"],
               "allow_parentheses": False, "allow_negation": False}


class EventLog:
    """Appends event lines to a file, one ``os.write`` each (atomic for a line, safe from any thread)."""

    def __init__(self, path: str | Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, *words: object) -> None:
        os.write(self.fd, (" ".join(map(str, words)) + "\n").encode())


class Recorder:
    """The worker's engine, unchanged, plus ``start``/``gen``/``drop`` events for each group it generates;
    ``generated`` counts the groups generated."""

    def __init__(self, engine, log: EventLog) -> None:
        self.engine, self.log, self.generated = engine, log, 0

    @property
    def version(self) -> int:
        return self.engine.version

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def generate(self, prompt_token_ids, n, sampling, request_id, seed=None):
        self.log("start", request_id)
        try:
            out = await self.engine.generate(prompt_token_ids, n, sampling, request_id, seed)
        except BaseException:
            self.log("drop", request_id)
            raise
        self.log("gen", request_id)
        self.generated += 1
        return out


def record_delivery(worker, log: EventLog) -> None:
    """Wrap the worker's ``_deliver``, ``spool.ack`` and ``replay.insert`` (instance attributes) to log ``done``,
    ``acked`` and ``retry`` events after the real call."""
    deliver, ack, insert = worker._deliver, worker.spool.ack, worker.replay.insert

    async def logged_deliver(table):
        await deliver(table)
        log("done", table.column("group_id")[0].as_py())

    def logged_ack(entry):
        ack(entry)
        log("acked", entry.path.name)

    def logged_insert(table):
        try:
            return insert(table)
        except ConnectionError:
            log("retry")
            raise

    worker._deliver, worker.spool.ack, worker.replay.insert = logged_deliver, logged_ack, logged_insert


async def start_engine(args):
    """``(engine, tokenizer, sampling)`` for ``--engine``."""
    from gyre.rollout.config import EngineConfig, SamplingConfig

    if args.engine == "fake":
        from tests.fakes import FakeTokenizer, SlowEngine

        return SlowEngine(["7"], delay_s=0.3), FakeTokenizer(), SamplingConfig()
    from transformers import AutoTokenizer

    from gyre.rollout.engine import RolloutEngine

    config = EngineConfig(model=args.model, kv_cache_gib=0.25, max_model_len=1024)
    engine = await RolloutEngine.start(config, initial_version=0)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return engine, AutoTokenizer.from_pretrained(args.model), sampling


def make_worker(args, engine, tokenizer, sampling, log: EventLog):
    from gyre.rollout.config import RolloutConfig
    from gyre.rollout.tasks import TaskConfig, TaskSource
    from gyre.rollout.worker import RolloutWorker
    from gyre.services.common.replay_client import ReplayClient

    config = RolloutConfig.model_construct(
        engine=None, sampling=sampling, group_size=GROUP_SIZE, groups_in_flight=3,
        max_ready_groups=100_000, retry_backoff_s=0.05, num_workers=1,
        spool_dir=args.spool, spool_max_groups=1000, spool_max_bytes=10**9)
    task = TaskSource(TaskConfig(params=TASK_PARAMS, heldout_size=4))
    client = ReplayClient(args.replay, timeout_s=10.0)
    worker = RolloutWorker("r0", config, task, Recorder(engine, log), client, tokenizer, seed=1)
    record_delivery(worker, log)
    return worker


async def serve(args) -> None:
    """Run the worker until killed, or (``--stop-after N``) until it generated N groups: then stop it, drain the
    spool into replay (30 s at most), log ``left``, shut the engine down and return."""
    log = EventLog(args.events)
    engine, tokenizer, sampling = await start_engine(args)
    worker = make_worker(args, engine, tokenizer, sampling, log)
    task = asyncio.create_task(worker.run())
    while args.stop_after is None or worker.engine.generated < args.stop_after:
        await asyncio.wait({task}, timeout=0.02)
        if task.done():
            task.result()  # run() ends only by raising here
    worker.stop()
    await task
    log("left", await worker.flusher.drain(30.0))
    if hasattr(engine, "shutdown"):
        await engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replay", required=True, help="replay address host:port")
    p.add_argument("--spool", required=True, help="spool directory")
    p.add_argument("--events", required=True, help="event log file (appended)")
    p.add_argument("--engine", choices=["fake", "vllm"], default="fake")
    p.add_argument("--model", help="HF model folder (--engine vllm)")
    p.add_argument("--stop-after", type=int, help="stop cleanly after this many groups generated")
    asyncio.run(serve(p.parse_args(argv)))


@dataclass
class Events:
    """What a worker process did so far, parsed from its event log (whole lines only)."""

    started: list[str] = field(default_factory=list)
    generated: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    acked: list[str] = field(default_factory=list)
    retries: int = 0
    left: int | None = None

    @property
    def in_flight(self) -> set[str]:
        """Request ids being generated now."""
        return set(self.started) - set(self.generated) - set(self.dropped)

    @property
    def generated_groups(self) -> set[str]:
        """Group ids (``"{prompt_index}-{attempt}"``) of the groups generated."""
        return {request_id.split("@")[0] for request_id in self.generated}

    @classmethod
    def read(cls, path: Path) -> Events:
        out = cls()
        text = path.read_text() if path.exists() else ""
        for line in text.splitlines(keepends=True):
            if not line.endswith("\n"):
                break
            kind, _, arg = line.strip().partition(" ")
            if kind == "retry":
                out.retries += 1
            elif kind == "left":
                out.left = int(arg)
            else:
                getattr(out, {"start": "started", "gen": "generated", "drop": "dropped"}.get(kind, kind)).append(arg)
        return out


class WorkerProcess:
    """``python -m tests.fault.rollout_proc`` in a session of its own; its output goes to ``{name}.log``."""

    def __init__(self, tmp_path: Path, name: str, replay: str, engine: str, model: str | None = None,
                 stop_after: int | None = None) -> None:
        self.events_path = tmp_path / f"{name}.events"
        cmd = [sys.executable, "-m", "tests.fault.rollout_proc", "--replay", replay, "--spool",
               str(tmp_path / "spool"), "--events", str(self.events_path), "--engine", engine]
        cmd += ["--model", model] if model else []
        cmd += ["--stop-after", str(stop_after)] if stop_after is not None else []
        self.log = open(tmp_path / f"{name}.log", "ab")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def events(self) -> Events:
        return Events.read(self.events_path)

    def wait_for(self, cond, what: str, timeout_s: float = 120.0) -> Events:
        """Poll the event log until ``cond(events)``; returns those events. Fails if the process exits first."""
        deadline = time.monotonic() + timeout_s
        while True:
            ev = self.events()
            if cond(ev):
                return ev
            rc = self.proc.poll()
            assert rc is None, f"worker exited with {rc} before: {what}; see {self.log.name}"
            assert time.monotonic() < deadline, f"not reached in {timeout_s}s: {what}; see {self.log.name}"
            time.sleep(0.02)

    def kill(self) -> int:
        """SIGKILL the worker's whole session (the worker and any engine process of its own); returns its exit code."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def wait(self, timeout_s: float) -> int:
        """Wait for a clean exit (``--stop-after``); returns the exit code (the worker is killed at the deadline)."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        self.log.close()
        return self.proc.returncode


if __name__ == "__main__":
    main()
