"""Real gRPC servers on port 0: replay round trip, bad input, weight streaming and resubscription."""

import threading
import time

import grpc
import pytest
import torch

from learner.publisher import WeightPublisher
from proto import replay_pb2, replay_pb2_grpc
from proto.trajectory import to_ipc
from replay.buffer import TrajectoryBuffer
from replay.config import ReplayConfig
from services import grpc_common, replay_server, weight_server
from services.replay_client import ReplayClient
from services.weight_client import WeightSubscriber
from tests.fakes import group_table


@pytest.fixture
def replay():
    buf = TrajectoryBuffer(ReplayConfig(max_batch_bytes=64 * 1024))
    server, port = replay_server.serve(buf)
    client = ReplayClient(f"127.0.0.1:{port}")
    yield buf, client, port
    client.close()
    server.stop(0)


def test_insert_sample_ack_over_grpc(replay):
    buf, client, port = replay
    assert grpc_common.check_health(f"127.0.0.1:{port}", replay_server.SERVICE_NAME)
    assert client.lease_prompts("r0", 2) == [(0, 0), (1, 0)]
    assert client.insert(group_table(0)).accepted == 4
    assert client.insert(group_table(0)).duplicates == 4
    lease_id, table = client.sample(1, learner_version=0, timeout_s=1)
    assert table.num_rows == 4
    assert client.ack([lease_id]) == 1
    info = client.info()
    assert (info.inserted_total, info.duplicates_total, info.acked_groups_total) == (4, 4, 1)


def test_sample_waits_for_late_insert(replay):
    _, client, _ = replay
    threading.Timer(0.3, lambda: client.insert(group_table(7))).start()
    got = client.sample(1, learner_version=0, timeout_s=5)
    assert got is not None and set(got[1].column("prompt_index").to_pylist()) == {7}


def test_bad_inputs_get_named_errors_and_change_nothing(replay):
    buf, client, port = replay
    stub = replay_pb2_grpc.ReplayServiceStub(grpc_common.channel(f"127.0.0.1:{port}"))

    def insert(**kw):
        return next(iter(stub.Insert(iter([replay_pb2.InsertRequest(**kw)]), timeout=5)))

    cases = [
        (dict(schema_version=9, arrow_ipc=to_ipc(group_table(0))), "schema_version 9 is not supported"),
        (dict(schema_version=1, arrow_ipc=b"junk"), "not an Arrow IPC stream"),
        (dict(schema_version=1, arrow_ipc=to_ipc(group_table(0, response_len=5000))), "limit is 65536"),
    ]
    for kwargs, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            insert(**kwargs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.ack(["nope"])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in err.value.details()
    assert buf.info()["inserted_total"] == 0
    assert client.insert(group_table(1)).accepted == 4  # still serving


def _weights(v):
    return [("w", torch.full((1000,), float(v), dtype=torch.bfloat16)), ("b", torch.arange(10.0) + v)]


def test_weights_stream_versions_forward_and_resume_after_server_restart():
    pub = WeightPublisher()
    server, port = weight_server.serve(pub)
    got = []
    sub = WeightSubscriber(f"127.0.0.1:{port}", lambda v, t: got.append((v, t)), name="t", backoff_s=0.1).start()
    pub.publish(0, _weights(0))
    pub.publish(1, _weights(1))
    _wait(lambda: got and got[-1][0] == 1)
    assert [v for v, _ in got] == sorted({v for v, _ in got})  # only increasing
    assert torch.equal(got[-1][1][0][1], _weights(1)[0][1])
    server.stop(0).wait()
    pub2 = WeightPublisher()
    pub2.publish(5, _weights(5))
    server2, _ = _serve_on(pub2, port)
    _wait(lambda: got[-1][0] == 5)
    assert sub.errors >= 1
    sub.stop()
    server2.stop(0)


def _serve_on(pub, port):
    for _ in range(50):
        try:
            return weight_server.serve(pub, port=port)
        except RuntimeError:
            time.sleep(0.1)
    raise RuntimeError(f"port {port} did not free up")


def _wait(cond, timeout=20):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
