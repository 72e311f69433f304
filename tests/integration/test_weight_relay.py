"""Relay fan-out (real gRPC): rollouts re-serve the chunks they receive; the learner sends one copy per child of its
own; a corrupting relay, a relay killed mid-version and a child joining mid-version all end with every subscriber
holding the learner's exact weights."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from gyre.learner.publisher import WeightPublisher
from gyre.services.common.aio_server import AioServer
from gyre.services.learner import weight_server
from gyre.services.rollout.transport.relay import RelayCache, relay_parent, serve_relay
from gyre.services.rollout.transport.subscriber import WeightSubscriber

CHUNK = 4096


def _named(version: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(version)
    return [(f"layers.{i}.w", torch.randn(64, 64, generator=gen).to(torch.bfloat16)) for i in range(4)]


def _wait(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class CountingServicer(weight_server.WeightServicer):
    """The learner's servicer, counting the bytes it sends; with ``gate`` set, it pauses after ``pause_after``
    chunks of each stream until the gate opens."""

    def __init__(self, publisher, pause_after: int | None = None):
        super().__init__(publisher, chunk_bytes=CHUNK)
        self.sent_bytes, self.streams = 0, 0
        self.pause_after, self.gate = pause_after, threading.Event()

    async def Subscribe(self, request, context):
        self.streams += 1
        self._in_stream = 0
        await super().Subscribe(request, context)

    async def _write(self, context, msg):
        self._in_stream += 1
        if self.pause_after is not None and self._in_stream > self.pause_after:
            while not self.gate.is_set():
                await asyncio.sleep(0.02)
        self.sent_bytes += len(msg)
        await super()._write(context, msg)


class Node:
    """A rollout's weight path: a subscriber to ``upstream`` (falling back to the learner) feeding its own relay."""

    def __init__(self, name: str, upstream: str, learner: str, cache: RelayCache | None = None):
        self.cache = cache or RelayCache()
        self.server, port = serve_relay(self.cache)
        self.address = f"127.0.0.1:{port}"
        self.got: list[tuple[int, list]] = []
        self.sub = WeightSubscriber(upstream, lambda v, t, tl: self.got.append((v, t)), name=name, backoff_s=0.05,
                                    max_backoff_s=0.2, chunk_timeout_s=5.0, fallbacks=(learner,),
                                    relay=self.cache).start()

    def versions(self) -> list[int]:
        return [v for v, _ in self.got]

    def stop(self) -> None:
        self.sub.stop()
        self.server.stop(0).wait()


def _learner(servicer_factory=CountingServicer, **kw):
    pub = WeightPublisher()
    server = AioServer()
    servicer = servicer_factory(pub, **kw)
    weight_server.add_servicer(servicer, server)
    port = server.start(weight_server.SERVICE_NAME)
    return pub, server, servicer, f"127.0.0.1:{port}"


def _same(got, named) -> bool:
    return [n for n, _ in got] == [n for n, _ in named] and all(torch.equal(a, b) for (_, a), (_, b) in
                                                                 zip(got, named))


def test_the_tree_parent_of_each_rollout():
    assert [relay_parent(i, fanout=2) for i in range(7)] == [None, 0, 0, 1, 1, 2, 2]
    assert max(relay_parent(i) for i in range(1, 257)) == 31  # 256 rollouts: 32 relays, 3 levels
    with pytest.raises(ValueError, match="index -1"):
        relay_parent(-1)


def test_a_tree_of_relays_brings_every_version_to_every_rollout_with_one_copy_from_the_learner():
    pub, server, servicer, learner = _learner()
    pub.publish(0, _named(0))
    nodes: list[Node] = []
    try:
        for i in range(7):  # fanout 2: 3 levels
            parent = relay_parent(i, fanout=2)
            nodes.append(Node(f"r{i}", learner if parent is None else nodes[parent].address, learner))
        _wait(lambda: all(n.versions() == [0] for n in nodes))
        sent_v0 = servicer.sent_bytes
        pub.publish(1, _named(1))
        _wait(lambda: all(n.versions() == [0, 1] for n in nodes))
        model_bytes = sum(t.numel() * 2 for _, t in _named(1))
        assert servicer.streams == 1 and servicer.sent_bytes - sent_v0 < 1.1 * model_bytes  # one copy, headers aside
        assert all(_same(n.got[-1][1], _named(1)) for n in nodes)
        assert sum(n.sub.errors for n in nodes) == 0 and sum(n.sub.fallback_versions for n in nodes) == 0
    finally:
        for n in nodes:
            n.stop()
        server.stop(0).wait()


class CorruptingCache(RelayCache):
    """A relay that flips one byte of the data of the 3rd chunk it relays (its own copy was fine)."""

    def add(self, version, timeline, raw, base=None):
        self.n = getattr(self, "n", 0) + 1
        if self.n == 3:
            raw = raw[:-1] + bytes([raw[-1] ^ 0xFF])
        super().add(version, timeline, raw, base)


def test_a_chunk_corrupted_by_a_relay_is_refused_counted_and_refetched_from_the_learner():
    """Without per-chunk checksums and the fallback the child would take the relay's copy again and again."""
    pub, server, servicer, learner = _learner()
    pub.publish(0, _named(0))
    bad = Node("bad-relay", learner, learner, cache=CorruptingCache())
    child = Node("child", bad.address, learner)
    try:
        _wait(lambda: child.versions() == [0])
        assert _same(child.got[0][1], _named(0)) and bad.versions() == [0]
        assert child.sub.errors >= 1 and child.sub.fallback_versions == 1  # refused, counted, fetched again
    finally:
        child.stop()
        bad.stop()
        server.stop(0).wait()


def test_a_relay_killed_mid_version_leaves_its_children_to_the_learner_and_a_late_joiner_gets_it_whole():
    pub, server, servicer, learner = _learner(pause_after=3)  # every learner stream stalls after 3 chunks
    pub.publish(0, _named(0))
    relay = Node("relay", learner, learner)
    children = [Node(f"c{i}", relay.address, learner) for i in range(3)]
    try:
        _wait(lambda: len(relay.cache.current.chunks if relay.cache.current else []) == 3)
        late = Node("late", relay.address, learner)  # joins mid-version: takes what the relay has so far
        children.append(late)
        relay.stop()  # killed with the version a third through
        servicer.gate.set()
        _wait(lambda: all(c.versions() == [0] for c in children))
        assert all(_same(c.got[0][1], _named(0)) for c in children)
        assert all(c.sub.errors >= 1 and c.sub.fallback_versions == 1 for c in children)
    finally:
        for c in children:
            c.stop()
        server.stop(0).wait()
