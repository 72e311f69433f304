"""``SampleStream``: a sampled batch of any size reaches the learner in row slices. ``Sample`` sends a batch as one
message, capped at ``grpc_common.MAX_MESSAGE_BYTES`` (256 MB: too small for long chain-of-thought batches); here the
cap is lowered to 1 MiB on both ends and a ~3 MB batch still arrives whole, through the client the learner uses.
On the code before it (``ReplayClient.sample`` over ``Sample``) this batch failed with RESOURCE_EXHAUSTED."""

import grpc
import pyarrow as pa
import pytest

from gyre.proto import replay_pb2
from gyre.proto.trajectory import SCHEMA_VERSION
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.services.common import grpc_common
from gyre.services.common.replay_client import ReplayClient
from gyre.services.replay import server as replay_server
from tests.fakes import group_table

CAP = 1 << 20


@pytest.fixture
def small_cap(monkeypatch):
    options = [(k, CAP if "message_length" in k else v) for k, v in grpc_common.CHANNEL_OPTIONS]
    monkeypatch.setattr(grpc_common, "CHANNEL_OPTIONS", options)
    monkeypatch.setattr(replay_server, "SAMPLE_SLICE_BYTES", CAP // 4, raising=False)


def test_a_batch_over_the_message_cap_arrives_whole_in_slices(small_cap):
    buf = TrajectoryBuffer(ReplayConfig())
    groups = [group_table(i, n=4, response_len=20_000) for i in range(4)]  # ~0.8 MB of Arrow per group
    for table in groups:
        buf.insert(table)
    expected = pa.concat_tables(groups)
    assert expected.nbytes > 2 * CAP
    server, port = replay_server.serve(buf, port=0)
    client = ReplayClient(f"127.0.0.1:{port}")
    try:
        lease_id, table = client.sample(4, learner_version=0, timeout_s=1.0, request_id="big")
        assert lease_id and table.num_rows == expected.num_rows
        assert sorted(table.column("trajectory_id").to_pylist()) == sorted(expected.column("trajectory_id").to_pylist())
        assert sum(len(r) for r in table.column("response_token_ids").to_pylist()) == 16 * 20_000
        again = client.sample(4, learner_version=0, timeout_s=1.0, request_id="big")  # a retry: the same lease
        assert again[0] == lease_id and again[1].equals(table)
        request = replay_pb2.SampleRequest(schema_version=SCHEMA_VERSION, num_groups=4, learner_version=0,
                                           timeout_s=1.0, request_id="big")
        with pytest.raises(grpc.RpcError) as err:  # the one-message RPC cannot carry it
            client._stub.Sample(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.sample(1, learner_version=0, timeout_s=0.0) is None  # nothing left: an empty stream
        bad = replay_pb2.SampleRequest(schema_version=SCHEMA_VERSION, num_groups=0)
        with pytest.raises(grpc.RpcError) as err:  # validated like Sample, the bad field named
            list(client._stub.SampleStream(bad, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_groups (0)" in err.value.details()
    finally:
        server.stop(0)
