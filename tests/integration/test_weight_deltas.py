"""Sparse delta versions over real gRPC: a subscriber holding the previous version gets only the changed elements,
through a relay too; a subscriber whose base is not what the learner thinks refuses the delta (the rebuilt tensor
fails its CRC-32C), counts it and takes the version whole."""

from __future__ import annotations

import time

import torch

from gyre.learner.publisher import WeightPublisher
from gyre.services.common.aio_server import AioServer
from gyre.services.learner import weight_server
from gyre.services.rollout.transport.relay import RelayCache, serve_relay
from gyre.services.rollout.transport.subscriber import WeightSubscriber
from tests.integration.test_weight_relay import CountingServicer


def _versions(n: int, changed: float = 0.03):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=gen).to(torch.bfloat16)
    out = []
    for _ in range(n):
        out.append([("w", w.clone()), ("b", torch.zeros(8))])
        flat = w.view(-1)
        idx = torch.randperm(flat.numel(), generator=gen)[:int(flat.numel() * changed)]
        flat[idx] = torch.randn(idx.numel(), generator=gen).to(torch.bfloat16)
    return out


def _wait(predicate, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _serve():
    pub = WeightPublisher()
    server = AioServer()
    servicer = CountingServicer(pub)
    weight_server.add_servicer(servicer, server)
    return pub, server, servicer, f"127.0.0.1:{server.start(weight_server.SERVICE_NAME)}"


def _same(got, named):
    return all(torch.equal(a, b) for (_, a), (_, b) in zip(got, named))


def test_versions_after_the_first_travel_as_sparse_deltas_through_a_relay():
    versions = _versions(3)
    model_bytes = sum(t.numel() * t.element_size() for _, t in versions[0])
    pub, server, servicer, learner = _serve()
    pub.publish(0, versions[0])
    cache = RelayCache()
    relay_server, port = serve_relay(cache)
    got: dict[str, list] = {"relay": [], "leaf": []}
    relay = WeightSubscriber(learner, lambda v, t, tl: got["relay"].append((v, t)), name="relay", relay=cache,
                             backoff_s=0.05).start()
    leaf = WeightSubscriber(f"127.0.0.1:{port}", lambda v, t, tl: got["leaf"].append((v, t)), name="leaf",
                            fallbacks=(learner,), backoff_s=0.05).start()
    try:
        _wait(lambda: [v for v, _ in got["leaf"]] == [0])
        for v in (1, 2):
            sent = servicer.sent_bytes
            pub.publish(v, versions[v])
            _wait(lambda: [x for x, _ in got["leaf"]][-1:] == [v])
            assert servicer.sent_bytes - sent < 0.15 * model_bytes  # 3% of elements changed: a delta
        assert _same(got["leaf"][-1][1], versions[2]) and _same(got["relay"][-1][1], versions[2])
        assert 0.02 < servicer.last_delta.changed_fraction < 0.04
        assert relay.errors == leaf.errors == 0 and leaf.fallback_versions == 0
    finally:
        leaf.stop()
        relay.stop()
        relay_server.stop(0).wait()
        server.stop(0).wait()


def test_a_delta_against_the_wrong_base_is_refused_counted_and_the_version_fetched_whole():
    """Without the CRC-32C check of the rebuilt tensor the subscriber would apply the delta to other weights."""
    versions = _versions(2)
    pub, server, servicer, learner = _serve()
    pub.publish(0, versions[0])
    got = []
    sub = WeightSubscriber(learner, lambda v, t, tl: got.append((v, t)), name="s", backoff_s=0.05).start()
    try:
        _wait(lambda: [v for v, _ in got] == [0])
        raw = sub.base[2]
        raw["w"] = bytes(len(raw["w"]))  # what it holds as version 0 is not version 0 after all
        pub.publish(1, versions[1])
        _wait(lambda: [v for v, _ in got] == [0, 1])
        assert _same(got[-1][1], versions[1]) and sub.errors == 1
    finally:
        sub.stop()
        server.stop(0).wait()


def test_delta_bases_0_sends_every_version_whole():
    """The A/B switch (``weight_transport.delta_bases: 0``): the same subscriber, holding the previous version, gets
    the next one whole."""
    from gyre.services.learner.actor import delta_bases

    assert delta_bases({"type": "grpc", "delta_bases": 0}) == 0 and delta_bases(None) == 2
    assert delta_bases({"type": "nccl"}) == 2
    versions = _versions(2)
    model_bytes = sum(t.numel() * t.element_size() for _, t in versions[0])
    pub = WeightPublisher(delta_bases=delta_bases({"type": "grpc", "delta_bases": 0}))
    server = AioServer()
    servicer = CountingServicer(pub)
    weight_server.add_servicer(servicer, server)
    learner = f"127.0.0.1:{server.start(weight_server.SERVICE_NAME)}"
    pub.publish(0, versions[0])
    got = []
    sub = WeightSubscriber(learner, lambda v, t, tl: got.append((v, t)), name="s", backoff_s=0.05).start()
    try:
        _wait(lambda: [v for v, _ in got] == [0])
        sent = servicer.sent_bytes
        pub.publish(1, versions[1])
        _wait(lambda: [v for v, _ in got] == [0, 1])
        assert servicer.sent_bytes - sent >= model_bytes and _same(got[-1][1], versions[1])
        assert servicer.last_delta is None and sub.errors == 0
    finally:
        sub.stop()
        server.stop(0).wait()
