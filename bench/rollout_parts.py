"""Pieces of ``bench.rollout``: weight-server subprocesses (gyre WeightService and a raw grpcio byte
stream baseline), subscriber clients, and the generation loops compared by ``rollout_overhead_ratio``."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import grpc
import torch

from bench.replay_parts import serving_address
from gyre.learner.publisher import WeightPublisher
from gyre.proto.tensor_chunks import encode_tensors
from gyre.services.common import grpc_common, port_file
from gyre.services.common.aio_server import AioServer
from gyre.services.learner import weight_server
from gyre.services.rollout.transport.subscriber import WeightSubscriber

REPO = Path(__file__).resolve().parents[1]
RAW_SERVICE, RAW_METHOD = "gyre.bench.v1.RawWeights", "/gyre.bench.v1.RawWeights/Subscribe"


def bench_tensors(total_bytes: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """bf16 tensors of a 135M-class model's sizes (9 MiB matrices) adding up to ~``total_bytes``."""
    gen = torch.Generator().manual_seed(seed)
    per, out = 576 * 8192, []
    for i in range(max(1, total_bytes // (per * 2))):
        out.append((f"layers.{i}.w", torch.randn(per, generator=gen).to(torch.bfloat16)))
    return out


def serve_weights(kind: str, port_file_path: str, total_bytes: int) -> None:
    """Subprocess body: serve one version of ``bench_tensors`` as gyre chunks or as raw bytes messages
    of the same size (``CHUNK_BYTES``) on the same server options, on a port the OS picks (written to
    ``port_file_path`` once serving), until SIGTERM."""
    named = bench_tensors(total_bytes)
    server = AioServer()
    if kind == "gyre":
        pub = WeightPublisher()
        pub.publish(0, named)
        weight_server.add_servicer(weight_server.WeightServicer(pub), server)
        name = weight_server.SERVICE_NAME
    else:
        blobs = [bytes(t.data) for t in encode_tensors(named)]
        chunk = weight_server.CHUNK_BYTES

        async def raw(request, context):
            for blob in blobs:
                for off in range(0, len(blob), chunk):
                    yield blob[off:off + chunk]
        handler = grpc.unary_stream_rpc_method_handler(raw, request_deserializer=lambda b: b,
                                                       response_serializer=lambda b: b)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(RAW_SERVICE, {"Subscribe": handler}),))
        name = RAW_SERVICE
    port_file.write(port_file_path, server.start(name, "127.0.0.1", 0))
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


class WeightServerProc:
    """A ``serve_weights`` subprocess; waits until it reported its port and is healthy.

    Raises:
        RuntimeError: the process exited, or did not serve within 120 s.
    """

    def __init__(self, kind: str, total_bytes: int) -> None:
        bound = Path(tempfile.mkdtemp(prefix="gyre-bench-port-")) / "port"
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.rollout", "--weights-server", kind, str(bound),
                                      str(total_bytes)], cwd=REPO)
        self.address = serving_address(bound, self.proc, f"weight server {kind}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def fetch_main(kind: str, address: str) -> None:
    """Subprocess body of ``process_fetch_s``: one subscriber (a rollout service's process) or one raw client.
    Prints ``ready``, waits for ``go`` on stdin, fetches the version (gyre: staged, CRC-32C-verified, assembled
    into tensors) or drains the raw stream, then prints the bytes it received."""
    print("ready", flush=True)
    sys.stdin.readline()
    if kind == "gyre":
        got, nbytes = threading.Event(), []
        sub = WeightSubscriber(address, lambda v, t, _tl: (nbytes.append(sum(x.numel() * x.element_size() for _, x in t)),
                                                      got.set()), name="bench").start()
        got.wait()
        sub.stop()
        print(nbytes[0], flush=True)
    else:
        seconds, nbytes = raw_fetch_s(address, 1)
        print(nbytes, flush=True)


def process_fetch_s(kind: str, address: str, subscribers: int) -> tuple[float, int]:
    """Seconds from ``go`` until each of ``subscribers`` client processes (``fetch_main``) holds the whole
    version — one process per subscriber, as rollout services are — and the bytes each received."""
    procs = [subprocess.Popen([sys.executable, "-m", "bench.rollout", "--fetch", kind, address], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(subscribers)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{kind} fetch process did not start (exit {p.poll()})")
        t0 = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        sizes = [int(p.stdout.readline()) for p in procs]
        return time.perf_counter() - t0, sizes[0]
    finally:
        for p in procs:
            p.wait(timeout=60)


def raw_fetch_s(address: str, subscribers: int) -> tuple[float, int]:
    """Seconds for ``subscribers`` clients to each drain the raw byte stream; and bytes per client."""
    got = [0] * subscribers

    def run(i: int) -> None:
        with grpc_common.channel(address) as ch:
            call = ch.unary_stream(RAW_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            for msg in call(b"", timeout=600):
                got[i] += len(msg)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(subscribers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, got[0]


async def bare_vllm_tokens(llm, prompts: list[list[int]], n: int, max_tokens: int) -> int:
    """Bare ``AsyncLLM.generate`` of every prompt (groups of ``n``) concurrently; returns tokens made.

    It requests what ``RolloutEngine.generate`` requests (``rollout/engine.py``): the same sampling
    settings, final outputs only, and the sampled token's logprob (``logprobs=0``: vLLM's sampler
    computes it and the output processor returns it per token), so both paths ask vLLM for the same work.
    """
    from vllm import SamplingParams
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)

    async def one(p: list[int]) -> int:
        final = None
        async for final in llm.generate(tokens_input(list(p)), params, f"bare-{uuid.uuid4().hex}"):
            pass
        return sum(len(c.token_ids) for c in final.outputs)
    return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def gyre_tokens(engine, prompts: list[list[int]], n: int, max_tokens: int) -> int:
    """The same load through ``RolloutEngine.generate`` (behaviour logprobs, version spans, ``Sample``s)."""
    from gyre.rollout.config import SamplingConfig

    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=max_tokens, ignore_eos=True)
    groups = await asyncio.gather(*(engine.generate(p, n, sampling, f"gyre-{uuid.uuid4().hex}") for p in prompts))
    return sum(len(s.token_ids) for g in groups for s in g)


class WeightFeed:
    """A rollout service's weight path in one process: an in-process learner ``WeightService`` and the
    engine's configured weight transport subscribed to it, applying every version it receives to ``engine``
    (``RolloutEngine.update_weights`` on ``loop``). Idle until ``publisher.publish``."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop) -> None:
        from gyre.services.rollout.transport import make_transport

        self.engine, self.loop = engine, loop
        self.publisher = WeightPublisher()
        self.server, port = weight_server.serve(self.publisher)
        self.arrived: list[float] = []
        """``perf_counter`` when each version had arrived, verified, at the subscriber."""
        self.applied_s: list[float] = []
        """Seconds ``update_weights`` took for each version."""
        self.transport = make_transport(engine._config.weight_transport, f"127.0.0.1:{port}", self._on_version,
                                        have_version=engine.version, name="bench").start()

    def _on_version(self, version: int, tensors, timeline: int = 0) -> None:
        self.arrived.append(time.perf_counter())
        future = asyncio.run_coroutine_threadsafe(self.engine.update_weights(version, tensors), self.loop)
        self.applied_s.append(future.result())

    def stop(self) -> None:
        self.transport.stop()
        self.server.stop(0)
