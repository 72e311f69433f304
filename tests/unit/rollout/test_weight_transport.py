"""Weight transports: config selection, checksums, refusals, announces, disk bootstrap. The broadcast transport's
group is tests/unit/rollout/test_weight_group.py."""

import json
from types import SimpleNamespace
import time

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from gyre.learner.publisher import WeightPublisher
from gyre.proto import weights_pb2
from gyre.proto.manifest import device_checksum, tensor_metas
from gyre.proto.tensor_chunks import ChunkError
from gyre.rollout.config import EngineConfig
from gyre.proto.weight_transport import GrpcTransportConfig, NcclTransportConfig
from gyre.services.common.aio_server import AioServer
from gyre.services.learner import weight_server
from gyre.services.rollout.transport import make_transport
from gyre.proto.exports import newest_export, write_export_version
from gyre.services.rollout.transport.grpc_transport import GrpcTransport
from gyre.services.rollout.transport.nccl import NcclTransport
from gyre.services.rollout.transport.subscriber import WeightSubscriber, parse_chunk

NCCL_CFG = NcclTransportConfig(backoff_s=0.1)


def named(v: float = 0.0):
    torch.manual_seed(int(v))
    return [("a.weight", (torch.randn(3, 5) + v).to(torch.bfloat16)), ("b.bias", torch.randn(7) + v),
            ("c.odd", torch.randn(3).to(torch.float16))]  # 6 bytes: checksummed byte-wise


def _wait(cond, timeout=20):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_device_checksum_sees_a_flipped_bit_and_swapped_words():
    t = torch.arange(64, dtype=torch.float32)
    flipped = t.clone()
    flipped.view(torch.int32)[10] ^= 1
    swapped = t.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    sums = {device_checksum(x) for x in (t, flipped, swapped)}
    assert len(sums) == 3 and device_checksum(t.clone()) == device_checksum(t)
    assert 0 <= device_checksum(torch.tensor([-1.0] * 5)) < 2**64


def test_config_selects_transport():
    assert EngineConfig.model_fields["weight_transport"].default == GrpcTransportConfig()
    assert isinstance(make_transport(GrpcTransportConfig(), "127.0.0.1:1", lambda v, t, _tl: None), GrpcTransport)
    assert isinstance(make_transport(NCCL_CFG, "127.0.0.1:1", lambda v, t, _tl: None, name="r0"), NcclTransport)


def test_nccl_config_is_validated_by_name():
    with pytest.raises(ValidationError, match="max_members"):
        NcclTransportConfig(max_members=0)
    with pytest.raises(ValidationError, match="backend"):
        NcclTransportConfig(backend="mpi")
    with pytest.raises(ValidationError, match="master_port"):  # the learner forms the group itself now
        NcclTransportConfig(master_port=29500)
    assert NcclTransportConfig(bucket_mb=0.5).bucket_bytes == 1 << 19
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        EngineConfig.model_validate({"model": ".", "weight_transport": {"type": "rdma"}})


@pytest.fixture
def learner():
    pub = WeightPublisher()
    server, port = weight_server.serve(pub)
    yield pub, f"127.0.0.1:{port}"
    pub.close()
    server.stop(0)


class _ReplayingServicer(weight_server.WeightServicer):
    """Sends one fixed version whatever the subscriber has (a learner restored from an old checkpoint), then
    ends the stream; records the ``have_version`` of every Subscribe request in ``requests``."""

    def __init__(self, version):
        pub = WeightPublisher()
        pub.publish(version, named(version))
        super().__init__(pub)
        self.requests = []

    async def _offers(self, request, manifest):
        self.requests.append(request.have_version)
        yield self.publisher.offer(-1, 0, manifest)


def test_subscriber_ignores_a_version_from_the_past():
    """The subscriber decided on the old version: it took the whole stream (a normal end, no error) and
    subscribed again, which it does only after handling every version the stream carried."""
    server = AioServer()
    servicer = _ReplayingServicer(1)
    weight_server.add_servicer(servicer, server)
    port = server.start(weight_server.SERVICE_NAME)
    got = []
    sub = WeightSubscriber(f"127.0.0.1:{port}", lambda v, t, _tl: got.append(v), have_version=3, backoff_s=0.1).start()
    _wait(lambda: len(servicer.requests) >= 2)
    sub.stop()
    server.stop(0)
    assert got == [] and sub.have_version == 3 and sub.errors == 0
    assert servicer.requests[:2] == [3, 3]


def test_refused_version_is_retried_and_the_subscriber_survives(learner):
    pub, address = learner
    calls = []

    def on_version(version, tensors, timeline):
        calls.append(version)
        if version == 1:
            raise ValueError("tensor 'a.weight' has shape (3, 5); the model expects (4, 5)")
    sub = WeightSubscriber(address, on_version, name="t", backoff_s=0.1).start()
    pub.publish(1, named(1))
    _wait(lambda: sub.errors >= 2)  # refused, retried after backoff, refused again
    assert sub.have_version == -1 and set(calls) == {1}
    pub.publish(2, named(2))
    _wait(lambda: sub.have_version == 2)
    sub.stop()


def test_announced_versions_do_not_wake_chunk_streams_and_a_version_may_be_both():
    pub = WeightPublisher()
    pub.announce(1, tensor_metas(named()))
    start = time.monotonic()
    assert pub.wait_newer(-1, timeout_s=0.3) is None and time.monotonic() - start >= 0.29
    assert pub.wait_newer_manifest(-1, timeout_s=0.1)[0] == 1 and pub.latest() == (1, 0)
    pub.publish(1, named())  # the same version over gRPC (for whoever is outside the broadcast group)
    assert pub.wait_newer(-1, timeout_s=0.1)[0] == 1 and pub.latest() == (1, 0)
    with pytest.raises(ValueError, match="version 1 is not newer than announced version 1"):
        pub.announce(1, tensor_metas(named()))


def _export(folder, version=None):
    folder.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    if version is not None:
        write_export_version(folder, version)


def test_newest_export_picks_the_highest_recorded_version(tmp_path):
    assert newest_export(tmp_path) is None
    _export(tmp_path / "step-3", 3)
    _export(tmp_path / "step-12", 12)
    _export(tmp_path / "final_policy")  # no version file: cannot be claimed
    assert newest_export(tmp_path) == (12, tmp_path / "step-12")
    assert newest_export(tmp_path / "step-3") == (3, tmp_path / "step-3")
    (tmp_path / "step-12" / "gyre_version.json").write_text(json.dumps({"policy_version": "x"}))
    with pytest.raises(ValueError, match="step-12/gyre_version.json: policy_version \\('x'\\) must be"):
        newest_export(tmp_path)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 70_000])
def test_hand_appended_data_field_parses_like_protobufs_own_encoding(size):
    from gyre.proto.tensor_chunks import TensorChunk
    data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    c = TensorChunk(version=7, name="w", dtype="bfloat16", shape=(size // 2,), offset=64, data=memoryview(data),
                    nbytes=size + 64, last_of_tensor=True, checksum=123, last_of_version=True, num_tensors=2)
    msg = weights_pb2.WeightChunk.FromString(weight_server.serialize_chunk(c))
    assert (msg.version, msg.name, msg.dtype, list(msg.shape), msg.offset, msg.data, msg.nbytes, msg.checksum,
            msg.last_of_tensor, msg.last_of_version, msg.num_tensors, msg.checksum_kind) == (
        7, "w", "bfloat16", [size // 2], 64, data, size + 64, 123, True, True, 2, "crc32c")


def test_parse_chunk_finds_data_wherever_protobuf_put_it_and_refuses_garbage():
    from gyre.services.rollout.transport.subscriber import parse_chunk
    msg = weights_pb2.WeightChunk(version=3, name="b.bias", dtype="float32", shape=[2, 3], offset=8,
                                  data=bytes(range(24)), nbytes=32, last_of_tensor=True, checksum=2**32 - 1,
                                  checksum_kind="crc32c")
    c = parse_chunk(msg.SerializeToString())  # protobuf's order: data (field 6) between others
    assert (c.version, c.name, c.dtype, c.shape, c.offset, bytes(c.data), c.nbytes, c.last_of_tensor, c.checksum,
            c.checksum_kind) == (3, "b.bias", "float32", (2, 3), 8, bytes(range(24)), 32, True, 2**32 - 1, "crc32c")
    assert bytes(parse_chunk(weights_pb2.WeightChunk(version=1).SerializeToString()).data) == b""
    with pytest.raises(ChunkError, match="malformed WeightChunk: truncated varint"):
        parse_chunk(weights_pb2.WeightChunk(version=3, checksum=2**32 - 1).SerializeToString()[:-3])
    with pytest.raises(ChunkError, match="wire type 7"):
        parse_chunk(b"\x0f\x00")
    with pytest.raises(ChunkError, match="runs past the end"):
        parse_chunk(weights_pb2.WeightChunk(name="w", data=b"x" * 10).SerializeToString()[:-2])


class _FakeEngine:
    def __init__(self, version):
        self.version, self.applied = version, []

    async def update_weights(self, version, named):
        self.applied.append((version, [n for n, _ in named]))
        self.version = version
        return 0.0


class _FakeTransport:
    """``latest`` answers in turn (the last one repeats); the ``deliver_at``-th answer delivers version ``deliver``."""

    def __init__(self, engine, latest, deliver=None, deliver_at=3):
        self.engine, self.latest, self.deliver, self.calls, self.started = engine, list(latest), deliver, 0, False
        self.deliver_at = deliver_at

    def start(self):
        self.started = True
        return self

    def latest_version(self, timeout_s=2.0):
        answer = self.latest[min(self.calls, len(self.latest) - 1)]
        self.calls += 1
        if self.deliver is not None and self.calls == self.deliver_at:
            self.engine.version = self.deliver
        return answer


def _boot(engine, transport, tmp_path, wait_s=0.5, bootstrap_dir=None):
    import asyncio
    from gyre.services.rollout.transport.bootstrap import bootstrap
    cfg = SimpleNamespace(bootstrap_wait_s=wait_s, bootstrap_dir=bootstrap_dir)
    return asyncio.run(bootstrap(engine, transport, cfg))


def test_bootstrap_waits_for_the_learner_then_reports_it(tmp_path):
    engine = _FakeEngine(0)
    result = _boot(engine, _FakeTransport(engine, [None, 6, 6, 6], deliver=6), tmp_path, wait_s=10)
    assert (result.version, result.source, result.learner_latest) == (6, "learner", 6)


def test_bootstrap_falls_back_to_disk_and_never_goes_back(tmp_path):
    _export(tmp_path / "step-5", 5)
    engine = _FakeEngine(0)
    result = _boot(engine, _FakeTransport(engine, [9]), tmp_path, bootstrap_dir=str(tmp_path))  # behind learner
    assert (result.version, result.source, result.learner_latest, engine.applied) == (5, "disk", 9, [(5, ["w"])])
    engine = _FakeEngine(7)  # already newer than the export: keep it
    result = _boot(engine, _FakeTransport(engine, [None]), tmp_path, bootstrap_dir=str(tmp_path))
    assert (result.version, result.source, engine.applied) == (7, "initial", [])


def test_bootstrap_cold_start_is_reported_not_silent(tmp_path, capsys):
    engine = _FakeEngine(0)
    result = _boot(engine, _FakeTransport(engine, [None]), tmp_path, wait_s=0.3)
    assert (result.version, result.source, result.learner_latest) == (0, "initial", None)
    assert "BOOTSTRAP_COLD_START" in capsys.readouterr().out


def test_a_stream_opened_while_stop_runs_is_cancelled_at_once():
    """``stop`` sets the event, then cancels the call in flight: a call opened in between (a reconnect racing the
    stop) was never cancelled and held the thread until the server sent something (seen as 10 s joins)."""
    sub = WeightSubscriber("127.0.0.1:1", lambda *a: None)

    class Call:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    sub._stop.set()  # stop() ran between the reconnect's check and its new call
    call = Call()
    assert sub._opened(call) is call and call.cancelled and sub._call is call


def test_a_rollout_on_dummy_weights_waits_for_a_version_and_never_cold_starts(tmp_path, capsys):
    """``load_format: dummy``: the engine starts at version -1 on random weights; a learner that does not answer
    within ``bootstrap_wait_s`` must not make it generate on them (it did: ``BOOTSTRAP_COLD_START`` at -1)."""
    engine = _FakeEngine(-1)
    transport = _FakeTransport(engine, [None] * 6 + [0], deliver=0, deliver_at=6)  # after the 0.3 s wait
    result = _boot(engine, transport, tmp_path, wait_s=0.3)
    assert (result.version, result.source) == (0, "learner") and transport.calls >= 6
    out = capsys.readouterr().out
    assert "bootstrap_waits_for_first_version" in out and "BOOTSTRAP_COLD_START" not in out
