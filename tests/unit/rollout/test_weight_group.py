"""The broadcast weight transport (``weight_transport: nccl``) over gloo on CPU: the learner's ``WeightGroup`` behind a
real weight server, rollouts' ``NcclTransport`` in threads of this process, the bucket plan and its double-buffered
send/receive, and every fault the group must survive (a member that never joins, a corrupted bucket, a full group,
a rollout joining or leaving between versions)."""

import threading
import time
from types import SimpleNamespace

import pytest
import structlog
import torch
import torch.distributed as dist

from gyre.learner.background_publish import BackgroundPublisher
from gyre.learner.publisher import WeightPublisher
from gyre.proto import weights_pb2
from gyre.proto.broadcast import group_broadcast, open_group
from gyre.proto.buckets import bucket_plan, receive_buckets, send_buckets
from gyre.proto.manifest import tensor_metas
from gyre.proto.tensor_chunks import ChunkError
from gyre.proto.weight_transport import NcclTransportConfig
from gyre.services.common import grpc_common
from gyre.services.learner import weight_server
from gyre.services.learner.weight_group import GroupMembers, WeightGroup
from gyre.services.rollout.transport.nccl import NcclTransport
from gyre.proto import weights_pb2_grpc

CFG = NcclTransportConfig(backend="gloo", bucket_mb=40 / (1 << 20), join_timeout_s=3.0, broadcast_timeout_s=10.0,
                          backoff_s=0.1, chunk_timeout_s=10.0)
"""40-byte buckets: every version below spans several, with tensors straddling them."""


def named(v: int):
    g = torch.Generator().manual_seed(v)
    return [("a.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
            ("b.bias", torch.randn(7, generator=g)), ("c.odd", torch.randn(3, generator=g).to(torch.float16)),
            ("d.empty", torch.zeros(0))]


def _wait(cond, timeout=30):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _exact(got, version):
    return [n for n, _ in got] == [n for n, _ in named(version)] and all(
        a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(got, named(version)))


def test_bucket_plan_covers_every_byte_once_and_straddles_tensors():
    sizes = [30, 0, 100, 7]
    plan = bucket_plan(sizes, 40)
    assert [sum(s.nbytes for s in b) for b in plan] == [40, 40, 40, 17]
    covered = {i: [] for i in range(len(sizes))}
    for bucket in plan:
        assert [s.bucket_offset for s in bucket] == [sum(x.nbytes for x in bucket[:k]) for k in range(len(bucket))]
        for s in bucket:
            covered[s.tensor].append((s.tensor_offset, s.nbytes))
    for i, n in enumerate(sizes):
        offsets = sorted(covered[i])
        assert sum(k for _, k in offsets) == n and all(a + k == b for (a, k), (b, _) in zip(offsets, offsets[1:]))
    assert bucket_plan([], 8) == [] and bucket_plan([0], 8) == []
    with pytest.raises(ValueError, match="bucket_bytes \\(0\\) must be >= 1"):
        bucket_plan([1], 0)


def _pair():
    """A two-rank gloo group in this process: ``[learner's, receiver's]``."""
    master = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    stores = [master, dist.TCPStore("127.0.0.1", master.port, None, False)]
    groups = [None, None]

    def make(rank):
        groups[rank] = open_group("gloo", dist.PrefixStore("t", stores[rank]), rank, 2,
                                  __import__("datetime").timedelta(seconds=10))
    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return groups


def test_buckets_arrive_bit_exact_and_a_flipped_bit_is_named_after_everything_arrived():
    groups = _pair()
    tensors = named(3)
    metas = tensor_metas(tensors)
    got = {}
    receiver = threading.Thread(target=lambda: got.update(
        ok=receive_buckets(group_broadcast(groups[1]), metas, 40, "cpu")))
    receiver.start()
    assert send_buckets(group_broadcast(groups[0]), [t for _, t in tensors], 40) == len(bucket_plan(
        [m.nbytes for m in metas], 40))
    receiver.join()
    assert _exact(got["ok"], 3)

    clean = group_broadcast(groups[0])

    def corrupting(t, src):
        if t.numel() and not got.get("flipped"):
            got["flipped"] = True
            t = t.clone()
            t[35] ^= 1  # byte 35 of the first bucket: inside b.bias (a.weight is 30 bytes)
        return clean(t, src)

    def receive():
        try:
            receive_buckets(group_broadcast(groups[1]), metas, 40, "cpu")
        except ChunkError as exc:
            got["error"] = str(exc)
    receiver = threading.Thread(target=receive)
    receiver.start()
    send_buckets(corrupting, [t for _, t in tensors], 40)
    receiver.join()
    assert "'b.bias'" in got["error"] and "checksum" in got["error"]


class Learner:
    """A learner's weight path: publisher, weight server with group membership, ``WeightGroup``, and the
    ``BackgroundPublisher`` that announces + broadcasts and publishes over gRPC side by side."""

    def __init__(self, config=CFG):
        self.publisher = WeightPublisher()
        self.members = GroupMembers()
        self.server, port = weight_server.serve(self.publisher, members=self.members)
        self.address = f"127.0.0.1:{port}"
        self.group = WeightGroup(config, self.publisher, self.members)
        self.background = BackgroundPublisher(self.publisher, SimpleNamespace(published=lambda v, n: None),
                                              group=self.group)

    def publish(self, version):
        self.background.submit(version, 0, named(version), wait=True)

    def close(self):
        self.background.close()
        self.publisher.close()
        self.server.stop(0)


class Rollout:
    def __init__(self, learner, name):
        self.got = {}
        self.transport = NcclTransport(CFG, learner.address, self._on_version, name=name).start()

    def _on_version(self, version, tensors, timeline):
        self.got[version] = tensors

    def stop(self):
        self.transport.stop()


@pytest.fixture
def learner():
    got = Learner()
    yield got
    got.close()


@pytest.fixture
def logs():
    with structlog.testing.capture_logs() as captured:
        yield captured


def _events(logs, name):
    return [e for e in logs if e["event"] == name]


def test_versions_travel_in_the_group_which_reforms_when_a_rollout_joins_or_leaves(learner):
    rollouts = [Rollout(learner, f"rollout-{i}") for i in range(2)]
    _wait(lambda: len(learner.members.snapshot()) == 2)
    learner.publish(1)
    _wait(lambda: all(1 in r.got for r in rollouts))
    assert all(_exact(r.got[1], 1) and r.transport.group_versions == 1 for r in rollouts)
    assert learner.group.sent == 1 and learner.group.reforms == 1

    late = Rollout(learner, "rollout-2")  # joins between versions: in the next group
    _wait(lambda: len(learner.members.snapshot()) == 3)
    assert late.transport.grpc_versions == 1 and _exact(late.got[1], 1)  # bootstrapped over gRPC, not a member
    learner.publish(2)
    _wait(lambda: all(2 in r.got for r in [*rollouts, late]))
    assert learner.group.reforms == 2 and late.transport.group_versions == 1
    assert all(_exact(r.got[2], 2) for r in [*rollouts, late])

    rollouts[0].stop()  # leaves: the next version re-forms without it, no wait on the dead member
    _wait(lambda: len(learner.members.snapshot()) == 2)
    start = time.monotonic()
    learner.publish(3)
    assert time.monotonic() - start < CFG.join_timeout_s
    _wait(lambda: 3 in late.got and 3 in rollouts[1].got)
    assert learner.group.reforms == 3 and learner.group.failed == 0
    assert late.transport.errors == 0 and rollouts[1].transport.errors == 0
    for r in [rollouts[1], late]:
        r.stop()


def test_a_member_that_never_joins_costs_one_version_over_grpc_then_is_left_out(learner, logs):
    """Without the join deadline the learner would wait for ever; without leaving it out, every later version
    would wait ``join_timeout_s`` and go over gRPC too."""
    rollout = Rollout(learner, "rollout-0")
    with grpc_common.channel(learner.address) as ch:  # follows the announces, never joins a group
        silent = weights_pb2_grpc.WeightServiceStub(ch).Announce(weights_pb2.SubscribeRequest(
            have_version=-1, subscriber="silent", incarnation="silent-1"))
        _wait(lambda: len(learner.members.snapshot()) == 2)
        learner.publish(1)
        _wait(lambda: 1 in rollout.got)
        assert learner.group.failed == 1 and rollout.transport.grpc_versions == 1 and _exact(rollout.got[1], 1)
        failed = _events(logs, "weights_group_failed")
        assert "did not join" in failed[0]["error"] and "'silent'" in failed[0]["error"]
        _wait(lambda: len(learner.members.snapshot()) == 2)  # the rollout re-opened its stream as a new incarnation
        learner.publish(2)
        _wait(lambda: 2 in rollout.got)
        assert learner.group.sent == 1 and learner.group.group_members == (rollout.transport.incarnation,)
        assert rollout.transport.group_versions == 1 and _exact(rollout.got[2], 2)
        silent.cancel()
    rollout.stop()


def test_a_corrupted_bucket_is_refused_and_the_version_fetched_over_grpc(learner, monkeypatch, logs):
    """Without the checksum check the flipped bit would be delivered (the version would not be bit-exact)."""
    rollouts = [Rollout(learner, f"rollout-{i}") for i in range(2)]
    _wait(lambda: len(learner.members.snapshot()) == 2)
    import gyre.services.learner.weight_group as wg

    real = wg.group_broadcast

    def corrupting(group):
        start, flipped = real(group), []

        def send(t, src):
            if not flipped:
                flipped.append(True)
                t = t.clone()
                t[0] ^= 1
            return start(t, src)
        return send
    monkeypatch.setattr(wg, "group_broadcast", corrupting)
    learner.publish(1)
    _wait(lambda: all(1 in r.got for r in rollouts))
    assert all(_exact(r.got[1], 1) and r.transport.grpc_versions == 1 for r in rollouts)
    refused = _events(logs, "weights_over_grpc")
    assert len(refused) == 2 and all("ChunkError" in e["reason"] and "'a.weight'" in e["reason"] for e in refused)
    monkeypatch.setattr(wg, "group_broadcast", real)
    learner.publish(2)
    _wait(lambda: all(2 in r.got for r in rollouts))
    assert all(_exact(r.got[2], 2) and r.transport.group_versions == 1 for r in rollouts)
    assert learner.group.reforms == 2  # the refusing members re-opened their streams: a new group
    for r in rollouts:
        r.stop()


def test_a_fleet_past_max_members_gets_the_rest_over_grpc_with_the_numbers_logged(logs):
    learner = Learner(CFG.model_copy(update={"max_members": 1}))
    try:
        rollouts = [Rollout(learner, f"rollout-{i}") for i in range(2)]
        _wait(lambda: len(learner.members.snapshot()) == 2)
        learner.publish(1)
        _wait(lambda: all(1 in r.got for r in rollouts))
        assert sorted(r.transport.group_versions for r in rollouts) == [0, 1]
        assert sorted(r.transport.grpc_versions for r in rollouts) == [0, 1]
        assert all(_exact(r.got[1], 1) for r in rollouts)
        full = _events(logs, "weights_group_full")
        outside = next(r for r in rollouts if r.transport.grpc_versions == 1).transport.name
        assert full[0]["rollouts"] == 2 and full[0]["max_members"] == 1 and full[0]["over_grpc"] == [outside]
        for r in rollouts:
            r.stop()
    finally:
        learner.close()


def test_nobody_following_announces_without_a_group_and_the_version_is_still_served(learner):
    learner.publish(1)
    assert learner.group.sent == 0 and learner.publisher.latest() == (1, 0)
    rollout = Rollout(learner, "rollout-0")
    _wait(lambda: 1 in rollout.got)
    assert rollout.transport.grpc_versions == 1 and _exact(rollout.got[1], 1)
    rollout.stop()


def test_a_rollout_that_cannot_use_the_backend_follows_as_a_non_member_and_spoils_no_group(logs):
    """A GPU-less rollout named in an NCCL group: without following as a non-member afterwards, it would re-join
    every version and every version's group would fail."""
    learner, rollout = Learner(), None
    try:
        learner.group.backend = "nccl"  # what the learner would pick on a GPU; this rollout has none
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
        rollout = Rollout(learner, "rollout-0")
        _wait(lambda: len(learner.members.snapshot()) == 1)
        learner.background.submit(1, 0, named(1), wait=False)  # announces the NCCL group, then fails it
        _wait(lambda: 1 in rollout.got)
        learner.background.flush()
        assert rollout.transport.can_join is False and _exact(rollout.got[1], 1)
        assert any("TransportUnavailableError" in e["reason"] for e in _events(logs, "weights_over_grpc"))
        try:
            _wait(lambda: learner.members.snapshot() == {})  # its stream is open, but not as a member
        except AssertionError:
            raise AssertionError(f"members {learner.members.snapshot()} inc={rollout.transport.incarnation!r} "
                                 f"can_join={rollout.transport.can_join} got={list(rollout.got)} "
                                 f"grpc={rollout.transport.grpc_versions} events={[e['event'] for e in logs][-30:]}")
        learner.group.backend = "gloo"
        learner.publish(2)
        _wait(lambda: 2 in rollout.got)
        assert learner.group.failed == 1 and rollout.transport.grpc_versions == 2
    finally:  # a rollout left running retried the closed learner every 10 s for the rest of the xdist worker
        if rollout is not None:
            rollout.stop()
        learner.close()
