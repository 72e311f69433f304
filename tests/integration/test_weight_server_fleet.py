"""The learner's weight server under a fleet's worth of open streams (real gRPC, real subscribers).

The threaded server this replaced tied one of its 16 threads to every open ``Subscribe`` stream: at 16 rollouts the
health ``Check`` queued behind them, timed out, and the supervisor restarted the learner after 3 such checks —
in a loop, as the rollouts reconnected — while a 17th rollout's ``Latest`` and ``Subscribe`` waited forever.
"""

from __future__ import annotations

import threading
import time

import grpc
import torch

from gyre.learner.publisher import WeightPublisher
from gyre.proto import weights_pb2
from gyre.services.common import grpc_common
from gyre.services.learner import weight_server
from gyre.services.rollout.transport.subscriber import (SUBSCRIBE_METHOD, WeightSubscriber, latest_version,
                                                         parse_chunk)

SUBSCRIBERS = 64
HEALTH_DEADLINE_S = 2.0  # the supervisor's check_timeout_s default


def _named(version: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(version)
    return [(f"layers.{i}.w", torch.randn(64, 32, generator=gen).to(torch.bfloat16)) for i in range(4)]


def _wait(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_64_subscribers_leave_health_and_latest_answered_and_all_get_each_version():
    pub = WeightPublisher()
    pub.publish(0, _named(0))
    server, port = weight_server.serve(pub)
    address = f"127.0.0.1:{port}"
    got: dict[int, list[int]] = {i: [] for i in range(SUBSCRIBERS)}
    lock = threading.Lock()

    def on_version(i):
        def record(version, tensors, timeline):
            with lock:
                got[i].append(version)
        return record

    subs = [WeightSubscriber(address, on_version(i), name=f"rollout-{i}", backoff_s=0.1).start()
            for i in range(SUBSCRIBERS)]
    try:
        _wait(lambda: all(got[i] == [0] for i in got))  # every stream open, past its first version
        for _ in range(3):  # the supervisor restarts after 3 failed checks in a row: none may fail
            t0 = time.monotonic()
            assert grpc_common.check_health(address, weight_server.SERVICE_NAME, timeout_s=HEALTH_DEADLINE_S)
            assert time.monotonic() - t0 < HEALTH_DEADLINE_S
        assert latest_version(address, timeout_s=HEALTH_DEADLINE_S) == 0  # a 65th caller is answered too
        pub.publish(1, _named(1))
        _wait(lambda: all(got[i] == [0, 1] for i in got))
        assert grpc_common.check_health(address, weight_server.SERVICE_NAME, timeout_s=HEALTH_DEADLINE_S)
        assert sum(s.errors for s in subs) == 0
    finally:
        for s in subs:
            s.stop()
        server.stop(0).wait()


def test_a_subscriber_that_never_reads_is_dropped_and_blocks_nobody():
    """A stream whose client takes nothing is cut off after ``write_timeout_s`` (the learner keeps publishing,
    others keep receiving); before, a stuck reader held its thread and its version for ever."""
    pub = WeightPublisher()
    pub.publish(0, [("w", torch.zeros(1 << 23, dtype=torch.bfloat16))])  # 16 MiB: more than flow control buffers
    server = weight_server.AioServer()
    weight_server.add_servicer(weight_server.WeightServicer(pub, chunk_bytes=64 << 10, write_timeout_s=1.0), server)
    port = server.start(weight_server.SERVICE_NAME)
    address = f"127.0.0.1:{port}"
    try:
        with grpc_common.channel(address) as ch:
            stuck = ch.unary_stream(SUBSCRIBE_METHOD,
                                    request_serializer=weights_pb2.SubscribeRequest.SerializeToString,
                                    response_deserializer=parse_chunk)(weights_pb2.SubscribeRequest(have_version=-1))
            first = next(stuck)  # opened, then never read again
            assert first.version == 0
            got = []
            other = WeightSubscriber(address, lambda v, t, tl: got.append(v), name="reader").start()
            pub.publish(1, [("w", torch.ones(1 << 23, dtype=torch.bfloat16))])
            _wait(lambda: got[-1:] == [1], timeout_s=30)
            other.stop()
            time.sleep(1.5)  # past the write timeout: the server gave up on the stuck stream
            try:
                for _ in stuck:
                    pass
                raise AssertionError("the stuck stream was not ended by the server")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
                assert "took no chunk" in exc.details()
    finally:
        server.stop(0).wait()
