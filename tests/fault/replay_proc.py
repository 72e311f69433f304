"""Crash-test harness: a real replay server process, a client that remembers what was acknowledged,
and a checker that reads the directory back (read-only, in this process) after each kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pyarrow as pa
import yaml

from gyre.replay.config import ReplayConfig
from gyre.replay.offline import inspect_dir
from gyre.services.common import grpc_common, port_file
from gyre.services.replay import server as replay_server
from gyre.services.common.replay_client import ReplayClient
from tests.fakes import group_table

REPO = Path(__file__).resolve().parents[2]


class ReplayProcess:
    """``python -m gyre.services.replay.main`` on ``dir`` (spawned, never forked), optionally with a fault point. It
    binds a port the OS picks (``--port 0``) and writes it to a file (``--port-file``): ``port`` and
    ``address`` are known once ``wait_serving`` returned."""

    def __init__(self, config: dict, directory: Path, fault_point: str | None = None) -> None:
        self.config, self.dir, self.port = config, directory, None
        cfg_file = directory.parent / f"{directory.name}.yaml"
        cfg_file.write_text(yaml.safe_dump(config))
        self.port_file = directory.parent / f"{directory.name}.port"
        self.port_file.unlink(missing_ok=True)  # the previous lifetime's
        env = {**os.environ, "GYRE_FAULT_POINT": fault_point or ""}
        self.log = open(directory.parent / f"{directory.name}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gyre.services.replay.main", "--config", str(cfg_file), "--dir", str(directory),
             "--port", "0", "--port-file", str(self.port_file)], cwd=REPO, env=env, stdout=self.log,
            stderr=subprocess.STDOUT)

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("the replay process has not reported its port yet (call wait_serving)")
        return f"127.0.0.1:{self.port}"

    def wait_serving(self, timeout_s: float = 60.0) -> None:
        """Wait for the port file, then for SERVING.

        Raises:
            RuntimeError: the process exited first.
            TimeoutError: not serving within ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        try:
            self.port = port_file.wait(self.port_file, self.proc, timeout_s)
        except RuntimeError:
            raise RuntimeError(f"replay exited with {self.proc.returncode}; see {self.log.name}") from None
        while not grpc_common.check_health(self.address, replay_server.SERVICE_NAME, timeout_s=0.5):
            if self.proc.poll() is not None:
                raise RuntimeError(f"replay exited with {self.proc.returncode}; see {self.log.name}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"replay at {self.address} not serving after {timeout_s}s")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()


class Inserter:
    """Threads that insert 2-group batches of fresh prompts until the server dies; every batch whose
    response arrived is *acknowledged*; a batch whose call failed is *in flight* and re-sent next time."""

    def __init__(self) -> None:
        self.acked: set[str] = set()
        self.sent: set[str] = set()
        self.in_flight: list[pa.Table] = []
        self._next = 0
        self._lock = threading.Lock()

    def _batch(self) -> pa.Table:
        with self._lock:
            if self.in_flight:
                return self.in_flight.pop()
            self._next += 2
            table = pa.concat_tables([group_table(self._next - 2, response_len=64),
                                      group_table(self._next - 1, response_len=64)])
            self.sent.update(table.column("trajectory_id").to_pylist())
            return table

    def _run(self, address: str, stop: threading.Event) -> None:
        client = ReplayClient(address, timeout_s=10.0)
        try:
            while not stop.is_set():
                table = self._batch()
                try:
                    client.insert(table)
                except (grpc.RpcError, ConnectionError):
                    with self._lock:
                        self.in_flight.append(table)
                    return
                with self._lock:
                    self.acked.update(table.column("trajectory_id").to_pylist())
        finally:
            client.close()

    def start(self, address: str, threads: int = 2) -> tuple[threading.Event, list[threading.Thread]]:
        stop = threading.Event()
        workers = [threading.Thread(target=self._run, args=(address, stop), daemon=True) for _ in range(threads)]
        for w in workers:
            w.start()
        return stop, workers


def churn(address: str, stop: threading.Event) -> None:
    """Snapshots, samples and releases while the inserters run (more record kinds, snapshots mid-kill)."""
    client = ReplayClient(address, timeout_s=10.0)
    try:
        while not stop.is_set():
            client.snapshot()
            got = client.sample(1, learner_version=0, timeout_s=0.0, consumer="checker")
            if got is not None:
                client.release([got[0]])
            client.lease_prompts("crash-test", 1)
    except (grpc.RpcError, ConnectionError):
        return
    finally:
        client.close()


def stored_ids(config: dict, directory: Path) -> Counter:
    """Trajectory ids the directory restores to, counted (read-only restore in this process)."""
    buf = inspect_dir(ReplayConfig(**{**config, "dir": str(directory)}))
    ids: Counter = Counter()
    for group in buf.state.store.groups.values():
        ids.update(group.table.column("trajectory_id").to_pylist())
    return ids
