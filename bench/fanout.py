"""Weight fan-out to a fleet: ``python -m bench.fanout --subscribers N`` (CPU; last line JSON).

A real learner weight server (``WeightService`` on ``grpc.aio``) and N simulated rollout identities in this process,
each with its own gRPC channel, ``WeightSubscriber`` and chunk checks; the identities that have children in
``relay_parent``'s tree (fan-out ``--fanout``) also serve a real relay (``RelayCache`` + ``RelayServicer`` on their own
``AioServer``). Three phases, each publishing ``--versions`` versions of ``--model-mb`` MB (bf16 matrices):

- ``direct`` (the baseline, measured in the same run): every identity subscribes to the learner, as before relays;
- ``relay``: the tree;
- ``relay_killed``: the tree, with ``--kill-fraction`` of the relays killed (server and subscriber stopped) while the
  version is on its way; their children fetch that version further up the tree;
- ``relay_delta``: the tree, each version changing ``--delta-density`` of the previous one's elements: versions travel
  as sparse deltas (``proto.sparse_delta``); ``changed_fraction`` is what the learner measured.

Per phase, for its last version: ``egress_ratio`` = bytes the learner's server wrote ÷ model bytes; ``p50_s`` /
``p99_s`` = seconds from publish until an identity holds the version (verified, every chunk and tensor checksum);
``cpu_s`` = this process's CPU seconds for that version (learner server, relays and subscribers together, on this
machine's cores); ``transfer_s`` = model bytes ÷ the loopback rate one subscriber alone gets (measured first);
``p99_over_transfer`` = ``p99_s`` ÷ ``transfer_s``; ``cpu_floor_s`` = ``cpu_s`` ÷ cores: every identity checks and
assembles every byte itself, so on one machine the fleet's p99 cannot beat that floor, whatever the fan-out (a
real fleet spreads it over its own hosts). ``egress_vs_direct`` = relay egress ÷ direct egress.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import threading
import time

import torch

from gyre.learner.publisher import WeightPublisher
from gyre.services.common.aio_server import AioServer
from gyre.services.learner import weight_server
from gyre.services.rollout.transport.relay import FANOUT, RelayCache, relay_ancestors, relay_parent, serve_relay
from gyre.services.rollout.transport.subscriber import WeightSubscriber, parse_chunk

from bench.rollout_parts import bench_tensors


class EgressServicer(weight_server.WeightServicer):
    """The learner's servicer, adding up the bytes it writes (the bench's egress meter). With ``hold_version`` set,
    the chunks of that version after its first wait for ``release`` (so relays can be killed mid-version)."""

    sent_bytes = 0
    hold_version: int | None = None
    release = threading.Event()

    async def _write(self, context, msg) -> None:
        if self.hold_version is not None and parse_chunk(msg).version == self.hold_version:
            if self._held_first:
                while not self.release.is_set():
                    await asyncio.sleep(0.001)
            self._held_first = True
        self.sent_bytes += len(msg)
        await super()._write(context, msg)

    def hold(self, version: int) -> None:
        self.hold_version, self._held_first, self.release = version, False, threading.Event()


class Identity:
    """One simulated rollout: a subscriber (to its parent relay, falling back to the learner), and a relay when it
    has children. Records when each version arrived."""

    def __init__(self, name: str, upstreams: list[str], relays: bool) -> None:
        self.arrived: dict[int, float] = {}
        self.cache = RelayCache() if relays else None
        self.server, self.address = None, None
        if relays:
            self.server, port = serve_relay(self.cache)
            self.address = f"127.0.0.1:{port}"
        self.sub = WeightSubscriber(upstreams[0], self._got, name=name, backoff_s=0.05, max_backoff_s=0.5,
                                    chunk_timeout_s=10.0, fallbacks=upstreams[1:], relay=self.cache).start()

    def _got(self, version, tensors, timeline) -> None:
        self.arrived[version] = time.perf_counter()

    def stop(self) -> None:
        self.sub.stop()
        if self.server is not None:
            self.server.stop(0).wait()


def build_fleet(n: int, learner: str, fanout: int | None) -> list[Identity]:
    """``n`` identities; ``fanout=None``: all on the learner; else ``relay_parent``'s tree."""
    fleet: list[Identity] = []
    has_children = {relay_parent(i, fanout) for i in range(1, n)} if fanout else set()
    for i in range(n):
        ancestors = relay_ancestors(i, fanout) if fanout else []
        upstreams = [fleet[a].address for a in ancestors] + [learner]  # parent, grandparent, ..., learner
        fleet.append(Identity(f"sim-{i}", upstreams, relays=i in has_children))
    return fleet


def _wait_all(fleet: list[Identity], version: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(version in f.arrived for f in fleet):
        if time.monotonic() > deadline:
            missing = sum(version not in f.arrived for f in fleet)
            raise TimeoutError(f"{missing} of {len(fleet)} subscribers lack version {version} after {timeout_s}s")
        time.sleep(0.005)


def perturbed(named: list, fraction: float, seed: int) -> list:
    """``named`` with ``fraction`` of each tensor's elements redrawn (what an RL step does to bf16 weights)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, t in named:
        t = t.clone()
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=gen)[:int(flat.numel() * fraction)]
        flat[idx] = torch.randn(idx.numel(), generator=gen).to(t.dtype)
        out.append((name, t))
    return out


def run_phase(n: int, fanout: int | None, versions: int, model_bytes: int, kill_fraction: float = 0.0,
              density: float | None = None, timeout_s: float = 600.0) -> dict:
    """One fleet, ``versions`` published versions (each ``density`` of the previous one's elements changed, or all
    drawn afresh); the figures of the last one (module docstring)."""
    pub = WeightPublisher()
    server = AioServer()
    servicer = EgressServicer(pub)
    weight_server.add_servicer(servicer, server)
    learner = f"127.0.0.1:{server.start(weight_server.SERVICE_NAME)}"
    named = bench_tensors(model_bytes, seed=0)
    pub.publish(0, named)
    fleet = build_fleet(n, learner, fanout)
    killed: list[Identity] = []
    try:
        _wait_all(fleet, 0, timeout_s)
        for v in range(1, versions + 1):
            named = bench_tensors(model_bytes, seed=v) if density is None else perturbed(named, density, seed=v)
            sent0, cpu0 = servicer.sent_bytes, time.process_time()
            kill = bool(kill_fraction) and v == versions
            if kill:
                servicer.hold(v)  # the learner sends v's first chunk, then waits until the relays are killed
            t0 = time.perf_counter()
            pub.publish(v, named)
            if kill:
                relays = [f for f in fleet if f.server is not None]
                killed = relays[-max(1, math.ceil(kill_fraction * len(relays))):]  # deepest first; the root last
                _wait_first_chunk(killed, v)
                for f in killed:
                    f.stop()
                servicer.release.set()
            alive = [f for f in fleet if f not in killed]
            _wait_all(alive, v, timeout_s)
            cpu = time.process_time() - cpu0
            waits = sorted(f.arrived[v] - t0 for f in alive)
            egress = (servicer.sent_bytes - sent0) / sum(t.numel() * t.element_size() for _, t in named)
        return {"egress_ratio": round(egress, 3), "p50_s": round(statistics.median(waits), 4),
                "p99_s": round(waits[min(len(waits) - 1, math.ceil(0.99 * len(waits)) - 1)], 4),
                "cpu_s": round(cpu, 3), "relays": sum(f.server is not None for f in fleet), "killed": len(killed),
                "fallback_versions": sum(f.sub.fallback_versions for f in fleet),
                "changed_fraction": (round(servicer.last_delta.changed_fraction, 4)
                                     if density is not None and servicer.last_delta is not None else None),
                "errors": sum(f.sub.errors for f in fleet)}
    finally:
        for f in fleet:
            if f not in killed:
                f.stop()
        pub.close()
        server.stop(0).wait()


def _wait_first_chunk(relays: list[Identity], version: int, timeout_s: float = 60.0) -> None:
    """Until every relay in ``relays`` holds the first chunk of ``version`` (the learner holds back the rest).

    Raises:
        TimeoutError: not within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while not all(r.cache.current is not None and r.cache.current.version == version for r in relays):
        if time.monotonic() > deadline:
            raise TimeoutError(f"relays did not get the first chunk of version {version} in {timeout_s}s")
        time.sleep(0.001)


def transfer_seconds(model_bytes: int) -> float:
    """Seconds one subscriber alone takes to receive a version from the learner here (loopback, this machine)."""
    return run_phase(1, None, 1, model_bytes)["p50_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subscribers", type=int, default=16)
    parser.add_argument("--model-mb", type=float, default=8.0, help="bytes per version (bf16), MB")
    parser.add_argument("--versions", type=int, default=2)
    parser.add_argument("--fanout", type=int, default=FANOUT)
    parser.add_argument("--kill-fraction", type=float, default=0.1)
    parser.add_argument("--delta-density", type=float, default=0.03,
                        help="fraction of elements changed per version in the sparse-delta phase")
    args = parser.parse_args()
    if (args.subscribers < 1 or args.versions < 1 or args.model_mb <= 0 or not 0 <= args.kill_fraction < 1
            or not 0 <= args.delta_density <= 1):
        parser.error("--subscribers and --versions must be >= 1, --model-mb > 0, --kill-fraction in [0, 1), "
                     "--delta-density in [0, 1]")
    model_bytes = int(args.model_mb * 1e6)
    transfer = transfer_seconds(model_bytes)
    direct = run_phase(args.subscribers, None, args.versions, model_bytes)
    relay = run_phase(args.subscribers, args.fanout, args.versions, model_bytes)
    killed = run_phase(args.subscribers, args.fanout, args.versions, model_bytes, args.kill_fraction)
    delta = run_phase(args.subscribers, args.fanout, args.versions, model_bytes, density=args.delta_density)
    cores = len(os.sched_getaffinity(0))
    for phase in (direct, relay, killed, delta):
        phase["p99_over_transfer"] = round(phase["p99_s"] / transfer, 2)
        phase["cpu_floor_s"] = round(phase["cpu_s"] / cores, 4)  # the whole fleet's checks on this machine's cores
    print(json.dumps({
        "bench": "fanout", "subscribers": args.subscribers, "fanout": args.fanout, "model_mb": args.model_mb,
        "cores": cores, "transfer_s": round(transfer, 4), "egress_vs_direct": round(relay["egress_ratio"] / direct["egress_ratio"], 4),
        "direct": direct, "relay": relay, "relay_killed": killed, "relay_delta": delta,
        "threads": threading.active_count()}))


if __name__ == "__main__":
    main()
