"""Weight sync into real vLLM (CPU, tiny Llama): a learner killed mid-transfer, bad versions refused
end to end, bootstrap from disk when the learner is unreachable. One engine serves the module."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gyre.learner.publisher import WeightPublisher
from gyre.rollout.config import EngineConfig, SamplingConfig
from gyre.rollout.engine import RolloutEngine
from gyre.services.common import port_file
from gyre.services.learner import weight_server
from gyre.services.rollout.transport import make_transport
from gyre.proto.exports import write_export_version
from gyre.services.rollout.transport.bootstrap import bootstrap

REPO = Path(__file__).resolve().parents[2]
PROMPT = [1, 2, 3, 4, 5]

# A learner process: publishes one perturbed version of the tiny model in 4 KiB chunks on `port` (0: one the OS
# picks), written to the port file `{marker}.up` once serving; with STALL set it writes the marker file after half
# the chunks and then hangs (the test SIGKILLs it there).
LEARNER = r"""
import asyncio, os, sys, time, torch
from safetensors.torch import load_file
from gyre.learner.publisher import WeightPublisher
from gyre.services.common import port_file
from gyre.services.learner import weight_server
model, version, port, marker = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
gen = torch.Generator().manual_seed(version)
named = [(n, (t.float() + 0.05 * torch.randn(t.shape, generator=gen)).to(torch.bfloat16))
         for n, t in sorted(load_file(model + "/model.safetensors").items())]
pub = WeightPublisher(); pub.publish(version, named)
from gyre.services.common.aio_server import AioServer
class Stalling(weight_server.WeightServicer):
    sent = 0
    async def _write(self, context, msg):
        if os.environ.get("STALL") and self.sent == 40:
            open(marker, "w").write("half")
            await asyncio.sleep(3600)
        self.sent += 1
        await super()._write(context, msg)
server = AioServer()
weight_server.add_servicer(Stalling(pub, chunk_bytes=4096), server)
port = server.start(weight_server.SERVICE_NAME, "127.0.0.1", port)
port_file.write(marker + ".up", port)
time.sleep(3600)
"""


def _perturbed(model: Path, version: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(version)
    return [(n, (t.float() + 0.05 * torch.randn(t.shape, generator=gen)).to(torch.bfloat16))
            for n, t in sorted(load_file(model / "model.safetensors").items())]


def _start_learner(model: Path, version: int, port: int, marker: Path, stall: bool) -> tuple[subprocess.Popen, int]:
    """A ``LEARNER`` process on ``port`` (0: one the OS picks; a restart passes the first one's: the rollout's
    address stays) and the port it serves on."""
    env = {**os.environ, "STALL": "1" if stall else ""}
    proc = subprocess.Popen([sys.executable, "-c", LEARNER, str(model), str(version), str(port), str(marker)],
                            cwd=REPO, env=env)
    return proc, port_file.wait(f"{marker}.up", proc, timeout_s=60.0)


@pytest.fixture(scope="module")
def engine_loop(tiny_llama, vllm_worker_process):  # weights cross vLLM's process boundary, as in `make run`
    loop = asyncio.new_event_loop()
    config = EngineConfig(model=str(tiny_llama), kv_cache_gib=0.25, max_model_len=512)
    engine = loop.run_until_complete(RolloutEngine.start(config, initial_version=3))
    yield engine, loop, config
    loop.run_until_complete(engine.shutdown())
    loop.close()


def _applier(engine, loop):
    return lambda v, t, _tl: asyncio.run_coroutine_threadsafe(engine.update_weights(v, t), loop).result()


async def _until(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def _sample_versions(engine) -> list[int]:
    samples = await engine.generate(PROMPT, 2, SamplingConfig(max_new_tokens=8), f"r-{time.monotonic_ns()}", seed=1)
    return sorted({v for s in samples for v in s.version_span_versions})


def test_learner_killed_mid_transfer_rollout_keeps_serving_then_catches_up(engine_loop, tiny_llama, tmp_path):
    engine, loop, config = engine_loop
    v = engine.version
    first, port = _start_learner(tiny_llama, v + 1, 0, tmp_path / "a", stall=True)
    transport = make_transport(config.weight_transport.model_copy(update={"chunk_timeout_s": 2.0,
                               "backoff_s": 0.2, "max_backoff_s": 1.0}), f"127.0.0.1:{port}",
                               _applier(engine, loop), have_version=v, name="r0")

    async def scenario():
        transport.start()
        await _until(lambda: (tmp_path / "a").exists(), 60)  # half the chunks of v+1 are staged
        first.send_signal(signal.SIGKILL)
        first.wait()
        for _ in range(3):  # the rollout keeps generating on the old version
            assert await _sample_versions(engine) == [v]
            await asyncio.sleep(0.5)
        assert engine.version == v and transport.errors >= 1
        greedy_before = (await engine.generate_greedy([PROMPT], 12))[0].token_ids
        second, _ = _start_learner(tiny_llama, v + 1, port, tmp_path / "b", stall=False)
        try:
            await _until(lambda: engine.version == v + 1, 30)
        finally:
            second.kill()
            second.wait()
        assert await _sample_versions(engine) == [v + 1]
        assert (await engine.generate_greedy([PROMPT], 12))[0].token_ids != greedy_before
    try:
        loop.run_until_complete(scenario())
    finally:
        transport.stop()
        if first.poll() is None:
            first.kill()
            first.wait()


def test_bad_versions_are_refused_and_the_engine_keeps_serving(engine_loop, tiny_llama):
    engine, loop, config = engine_loop
    v, pub = engine.version, WeightPublisher()
    server, port = weight_server.serve(pub)
    transport = make_transport(config.weight_transport.model_copy(update={"backoff_s": 0.2}), f"127.0.0.1:{port}",
                               _applier(engine, loop), have_version=v, name="r1")
    good = _perturbed(tiny_llama, 50)
    q = "model.layers.0.self_attn.q_proj.weight"
    bad = [
        [(n, t[:-1] if n == q else t) for n, t in good],  # wrong shape
        good + [("model.layers.9.mlp.not_a_proj.weight", torch.zeros(2, 2, dtype=torch.bfloat16))],  # unknown name
    ]

    async def scenario():
        transport.start()
        before = (await engine.generate_greedy([PROMPT], 12))[0].token_ids
        for i, weights in enumerate(bad):
            pub.publish(v + 1 + i, weights)
            await _until(lambda: transport.errors >= i + 1, 20)
            assert engine.version == v and await _sample_versions(engine) == [v]
            assert (await engine.generate_greedy([PROMPT], 12))[0].token_ids == before
        pub.publish(v + 10, good)
        await _until(lambda: engine.version == v + 10, 30)
    try:
        loop.run_until_complete(scenario())
    finally:
        transport.stop()
        server.stop(0)


def test_bootstrap_from_disk_when_the_learner_is_unreachable_then_from_the_learner(engine_loop, tiny_llama, tmp_path):
    engine, loop, config = engine_loop
    export = tmp_path / "exports" / "step-100"
    export.mkdir(parents=True)
    disk_version = engine.version + 100
    save_file(dict(_perturbed(tiny_llama, disk_version)), str(export / "model.safetensors"))
    write_export_version(export, disk_version)
    cfg = config.model_copy(update={"bootstrap_wait_s": 1.0, "bootstrap_dir": str(tmp_path / "exports")})
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: refused, and no other process can listen there meanwhile
    dead = make_transport(cfg.weight_transport, f"127.0.0.1:{closed.getsockname()[1]}", _applier(engine, loop),
                          have_version=engine.version, name="r2")
    try:
        result = loop.run_until_complete(bootstrap(engine, dead, cfg))
    finally:
        dead.stop()
        closed.close()
    assert (result.version, result.source, result.learner_latest, result.path) == (
        disk_version, "disk", None, str(export))
    assert engine.version == disk_version

    pub = WeightPublisher()
    pub.publish(disk_version + 1, _perturbed(tiny_llama, 7))
    server, port = weight_server.serve(pub)
    live = make_transport(cfg.weight_transport, f"127.0.0.1:{port}", _applier(engine, loop),
                          have_version=engine.version, name="r3")
    try:
        result = loop.run_until_complete(bootstrap(engine, live, cfg.model_copy(update={"bootstrap_wait_s": 30})))
    finally:
        live.stop()
        server.stop(0)
    assert (result.version, result.source, result.learner_latest) == (disk_version + 1, "learner", disk_version + 1)
    assert engine.version == disk_version + 1
