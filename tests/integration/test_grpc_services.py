"""Real gRPC servers on port 0: replay round trip, bad input, rate limiting, restart on a directory,
metrics; weight streaming and resubscription; a port another server holds is refused."""

import threading
import time
import urllib.request

import grpc
import pyarrow as pa
import pytest
import torch

from gyre.learner.publisher import WeightPublisher
from gyre.proto import replay_pb2, replay_pb2_grpc
from gyre.proto.trajectory import SCHEMA_VERSION, to_ipc
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.services.common import grpc_common
from gyre.services.learner import weight_server
from gyre.services.replay import server as replay_server
from gyre.services.common.replay_client import ReplayClient
from gyre.services.replay.metrics import serve_metrics
from gyre.services.rollout.transport.subscriber import WeightSubscriber
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
    late = threading.Timer(0.3, lambda: client.insert(group_table(7)))
    late.start()
    got = client.sample(1, learner_version=0, timeout_s=5)
    late.join()  # the insert's own response may arrive after the sample's
    assert got is not None and set(got[1].column("prompt_index").to_pylist()) == {7}


def _raw_ipc(table) -> bytes:
    """IPC bytes of a table that skips ``to_ipc``'s validation (to send deliberately bad data)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _bad_tables():
    good = group_table(0)
    col = good.schema.get_field_index("behaviour_logprobs")
    lengths = good.set_column(col, good.schema.field(col), pa.array([[-0.5]] * 4, pa.list_(pa.float32())))
    nan = good.set_column(good.schema.get_field_index("reward"), good.schema.field("reward"),
                          pa.array([0.0, float("nan"), 1.0, 0.0], pa.float32()))
    ids = good.set_column(0, good.schema.field(0), pa.array(["0-0-0", "x", "0-2-0", "0-3-0"]))
    return [
        (good.drop_columns(["reward"]), "missing column 'reward'"),
        (lengths, "response_token_ids has 3 tokens but behaviour_logprobs has 1"),
        (nan, "reward nan is not finite"),
        (ids, "trajectory_id 'x' is not"),
        (good.replace_schema_metadata({b"gyre.schema_version": b"7"}), "trajectory schema version 7 is not supported"),
    ]


def test_bad_inputs_get_named_errors_and_change_nothing(replay):
    buf, client, port = replay
    stub = replay_pb2_grpc.ReplayServiceStub(grpc_common.channel(f"127.0.0.1:{port}"))

    def insert(**kw):
        return next(iter(stub.Insert(iter([replay_pb2.InsertRequest(**kw)]), timeout=5)))

    cases = [
        (dict(schema_version=9, arrow_ipc=to_ipc(group_table(0))), "schema_version 9 is not supported"),
        (dict(schema_version=SCHEMA_VERSION, arrow_ipc=b"junk"), "not an Arrow IPC stream"),
        (dict(schema_version=SCHEMA_VERSION, arrow_ipc=to_ipc(group_table(0, response_len=5000))), "limit is 65536"),
    ] + [(dict(schema_version=SCHEMA_VERSION, arrow_ipc=_raw_ipc(t)), m) for t, m in _bad_tables()]
    for kwargs, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            insert(**kwargs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details(), message
    with pytest.raises(grpc.RpcError) as err:
        client.ack(["nope"])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.update_priorities(["0-0"], [float("inf")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority inf for group '0-0'" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.snapshot()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = buf.info()
    assert (info["inserted_total"], info["stored_groups"], info["prompts_completed"]) == (0, 0, 0)
    assert client.insert(group_table(1)).accepted == 4  # still serving


def test_rate_limited_insert_is_resource_exhausted_and_retryable(tmp_path):
    cfg = ReplayConfig(rate_limiter={"samples_per_insert": 1.0, "error_buffer": 1.0}, insert_timeout_s=0.2)
    server, port = replay_server.serve(TrajectoryBuffer(cfg))
    client = ReplayClient(f"127.0.0.1:{port}")
    client.insert(group_table(0))
    client.insert(group_table(1))
    with pytest.raises(ConnectionError, match="RESOURCE_EXHAUSTED.*waiting for samples"):
        client.insert(group_table(2))
    client.sample(1, 0, timeout_s=1)
    assert client.insert(group_table(2)).accepted == 4
    client.close()
    server.stop(0)


def test_durable_replay_keeps_leases_and_prompts_across_a_restart(tmp_path):
    cfg = ReplayConfig(dir=str(tmp_path), num_prompts=3, snapshot={"interval_s": None, "wal_bytes": None})
    buf = TrajectoryBuffer(cfg)
    server, port = replay_server.serve(buf)
    client = ReplayClient(f"127.0.0.1:{port}")
    assert client.lease_prompts("r0", 3) == [(0, 0), (1, 0), (2, 0)]
    for i in range(3):
        client.insert(group_table(i))
    lease, _ = client.sample(2, 0, timeout_s=1)
    assert client.snapshot().endswith("snap-00000000000000000006")  # 6 records: prompts, 3 inserts, version, lease
    client.close()
    server.stop(0).wait()
    buf.close()
    buf = TrajectoryBuffer(cfg)  # a restart on the same directory
    server, port = replay_server.serve(buf)
    client = ReplayClient(f"127.0.0.1:{port}")
    info = client.info()
    assert (info.stored_groups, info.leased_groups, info.prompts_completed, info.active_leases) == (3, 2, 3, 1)
    assert client.ack([lease]) == 2 and client.lease_prompts("r1", 1) == []
    assert client.info().wal_bytes > 0 and client.info().last_snapshot_age_s >= 0
    client.close()
    server.stop(0)
    buf.close()


def test_prometheus_metrics_endpoint(replay):
    buf, client, _ = replay
    client.insert(group_table(0))
    client.sample(1, 2, timeout_s=1)
    port = serve_metrics(buf, 0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in ("gyre_replay_stored_groups 1.0", "gyre_replay_inserted_total 4.0", "gyre_replay_leased_groups 1.0",
                 'gyre_replay_staleness_at_sample_bucket{le="2.0"} 1.0', "gyre_replay_inserts_per_s"):
        assert line in text, line


def _weights(v):
    return [("w", torch.full((1000,), float(v), dtype=torch.bfloat16)), ("b", torch.arange(10.0) + v)]


def test_weights_stream_versions_forward_and_resume_after_server_restart():
    pub = WeightPublisher()
    server, port = weight_server.serve(pub)
    got = []
    sub = WeightSubscriber(f"127.0.0.1:{port}", lambda v, t, _tl: got.append((v, t)), name="t", backoff_s=0.1).start()
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


def test_a_port_another_server_holds_is_refused_not_shared():
    # gRPC's default SO_REUSEPORT would let both bind and split the connections between them
    server, port = weight_server.serve(WeightPublisher())
    try:
        with pytest.raises(RuntimeError, match="bind"):
            weight_server.serve(WeightPublisher(), port=port)
    finally:
        server.stop(0)


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
