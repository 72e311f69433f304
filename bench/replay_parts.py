"""Parts of ``bench.replay``: realistic trajectory payloads, server subprocesses (the replay service
or a baseline of ``bench.replay_baselines``), and the streaming/timing helpers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import yaml

from bench.replay_baselines import KINDS
from gyre.proto import replay_pb2
from gyre.proto.trajectory import SCHEMA_VERSION, TRAJECTORY_SCHEMA, to_ipc
from gyre.services.common import grpc_common, port_file

REPO = Path(__file__).resolve().parents[1]
GROUP_SIZE, PROMPT_LEN, RESPONSE_LEN = 8, 64, 192


def trajectory_batch(first_prompt: int, groups: int, rng: np.random.Generator) -> pa.Table:
    """``groups`` GRPO groups of ``GROUP_SIZE`` rows with random tokens/logprobs (~1.9 KB per row)."""
    n = groups * GROUP_SIZE
    prompt = np.repeat(np.arange(first_prompt, first_prompt + groups), GROUP_SIZE)
    sample = np.tile(np.arange(GROUP_SIZE, dtype=np.int32), groups)

    def lists(length: int, values) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(np.arange(0, n * length + 1, length, dtype=np.int32)), values)

    cols = {
        "trajectory_id": [f"{p}-{s}-0" for p, s in zip(prompt.tolist(), sample.tolist())],
        "group_id": [f"{p}-0" for p in prompt.tolist()], "prompt_index": prompt, "sample_index": sample,
        "attempt": np.zeros(n, np.int32), "task": ["bench"] * n,
        "prompt_token_ids": lists(PROMPT_LEN, pa.array(rng.integers(0, 49152, n * PROMPT_LEN, dtype=np.int32))),
        "response_token_ids": lists(RESPONSE_LEN, pa.array(rng.integers(0, 49152, n * RESPONSE_LEN, dtype=np.int32))),
        "behaviour_logprobs": lists(RESPONSE_LEN, pa.array(-rng.exponential(1.0, n * RESPONSE_LEN).astype(np.float32))),
        "reward": rng.integers(0, 2, n).astype(np.float32), "finish_reason": ["stop"] * n,
        "version_span_starts": lists(1, pa.array(np.zeros(n, np.int32))),
        "version_span_versions": lists(1, pa.array(np.zeros(n, np.int64))),
        "reward_fn_version": ["v1"] * n, "rollout_id": ["bench"] * n, "created_at": np.zeros(n),
        "loss_mask": lists(RESPONSE_LEN, pa.array(np.ones(n * RESPONSE_LEN, np.int8))),
        "turn_starts": lists(1, pa.array(np.zeros(n, np.int32))),
    }
    arrays = [_column(cols.get(f.name), f.type, n) for f in TRAJECTORY_SCHEMA]  # by name: columns may be added
    return pa.Table.from_arrays(arrays, schema=TRAJECTORY_SCHEMA)


def _column(values, type_: pa.DataType, n: int) -> pa.Array:
    """``values`` as an Arrow array of ``type_``; a column the bench does not know is ``n`` empty values."""
    if isinstance(values, pa.Array):
        return values
    if values is not None:
        return pa.array(values, type=type_)
    if pa.types.is_string(type_):
        return pa.array([""] * n, type_)
    if pa.types.is_list(type_):
        return pa.array([[]] * n, type_)
    return pa.array(np.zeros(n)).cast(type_)


def requests(first_prompt: int, batches: int, groups: int, seed: int):
    """InsertRequests of fresh prompts (lazily built)."""
    rng = np.random.default_rng(seed)
    for b in range(batches):
        payload = to_ipc(trajectory_batch(first_prompt + b * groups, groups, rng))
        yield replay_pb2.InsertRequest(schema_version=SCHEMA_VERSION, batch_id=b, arrow_ipc=payload)


def stream(address: str, reqs, method: str = "/gyre.replay.v1.ReplayService/Insert") -> int:
    """Send ``reqs`` on one pipelined bidi stream; returns payload bytes once every response arrived."""
    total = 0

    def counted():
        nonlocal total
        for r in reqs:
            total += len(r.arrow_ipc)
            yield r

    with grpc_common.channel(address) as ch:
        call = ch.stream_stream(method, request_serializer=replay_pb2.InsertRequest.SerializeToString,
                                response_deserializer=replay_pb2.InsertResponse.FromString)
        for _ in call(counted(), timeout=3600):
            pass
    return total


class Server:
    """A server subprocess: a baseline (``bench.replay_baselines.KINDS``; ``append`` and ``durable``
    log to ``directory``) or ``replay``, the replay service on ``directory`` with ``config``. It binds a port
    the OS picks and reports it through a port file (``services.common.port_file``); serving on return.

    Raises:
        RuntimeError: the process exited, or did not serve within 120 s.
    """

    def __init__(self, kind: str, directory: Path | None = None, config: dict | None = None) -> None:
        bound = Path(tempfile.mkdtemp(prefix="gyre-bench-port-")) / "port"
        if kind in KINDS:
            cmd = [sys.executable, "-m", "bench.replay", "--baseline", kind, "--baseline-port-file", str(bound)]
            if directory is not None:
                directory.mkdir(parents=True, exist_ok=True)
                cmd += ["--dir", str(directory)]
        else:
            cfg = directory.with_suffix(".yaml")
            cfg.write_text(yaml.safe_dump(config))
            cmd = [sys.executable, "-m", "gyre.services.replay.main", "--config", str(cfg), "--dir", str(directory),
                   "--port", "0", "--port-file", str(bound)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.address = serving_address(bound, self.proc, " ".join(cmd))

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system, all threads) the server process has used so far."""
        return sum(psutil.Process(self.proc.pid).cpu_times()[:2])

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=120)


def sequential_write_mb_s(directory: Path, nbytes: int) -> float:
    """MB/s of writing ``nbytes`` from memory (a buffer too big for CPU caches, like a snapshot's
    source) in 8 MiB chunks to a new file in ``directory``, then fsyncing it."""
    source = np.random.default_rng(0).integers(0, 256, min(nbytes, 1 << 30), dtype=np.uint8).data
    chunk, path, written = 8 << 20, directory / "seqwrite.bin", 0
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    while written < nbytes:
        at = written % len(source)
        written += os.write(fd, source[at: at + min(chunk, nbytes - written, len(source) - at)])
    os.fsync(fd)
    os.close(fd)
    seconds = time.perf_counter() - t0
    path.unlink()
    return nbytes / 1e6 / seconds


def snapshot_bytes(path: Path) -> int:
    """Bytes of the files in the snapshot directory ``path`` (its Arrow files, state and manifest).

    Raises:
        FileNotFoundError: ``path`` is not a directory.
    """
    if not path.is_dir():
        raise FileNotFoundError(f"no snapshot directory at {path}")
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def fsync_ms(directory: Path, n: int = 200) -> tuple[float, float]:
    """p50 and p99 of append-4-KiB-then-fsync on ``directory``'s disk (context for every durable latency)."""
    path, out = directory / "fsync.bin", []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    for _ in range(n):
        os.write(fd, b"x" * 4096)
        t0 = time.perf_counter()
        os.fsync(fd)
        out.append(time.perf_counter() - t0)
    os.close(fd)
    path.unlink()
    return float(np.percentile(out, 50) * 1000), p99_ms(out)


def p99_ms(seconds: list[float]) -> float:
    return float(np.percentile(np.asarray(seconds) * 1000.0, 99))


def serving_address(bound: Path, proc: subprocess.Popen, what: str, timeout_s: float = 120.0) -> str:
    """``127.0.0.1:PORT`` of a server process ``proc`` that writes its bound port to ``bound``
    (``services.common.port_file``), once it answers SERVING on gRPC health; ``bound``'s folder is removed.

    Raises:
        RuntimeError: naming ``what``, when the process exited or did not serve within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    try:
        address = f"127.0.0.1:{port_file.wait(bound, proc, timeout_s)}"
    except (RuntimeError, TimeoutError) as exc:
        raise RuntimeError(f"{what} did not start: {exc}") from None
    finally:
        shutil.rmtree(bound.parent, ignore_errors=True)
    while not grpc_common.check_health(address, timeout_s=0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return address
