"""A real, durable replay gRPC server on port 0 for the fuzz tests, and the checks every rejected input
must pass: a named status code, the server still healthy, nothing stored changed."""

from __future__ import annotations

import grpc

from gyre.proto import replay_pb2, replay_pb2_grpc
from gyre.proto.trajectory import SCHEMA_VERSION, to_ipc
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.services.common import grpc_common
from gyre.services.replay import server as replay_server
from tests.fakes import group_table
from tests.fuzz.bad_trajectories import MAX_BATCH_BYTES

NAMED_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION})
"""Status codes a bad input may get; UNKNOWN/INTERNAL (an unhandled exception) or CANCELLED is a bug."""

_MOVING = {"inserts_per_s", "samples_per_s", "last_snapshot_age_s", "restore_seconds", "last_snapshot_seconds"}
"""Info fields that change with time alone (rates over a window, ages)."""


class ReplayUnderTest:
    """A durable ``TrajectoryBuffer`` behind ``replay_server.serve`` on 127.0.0.1:0, plus a raw stub."""

    def __init__(self, directory) -> None:
        self.buffer = TrajectoryBuffer(ReplayConfig(
            dir=str(directory), max_batch_bytes=MAX_BATCH_BYTES, insert_timeout_s=0.5,
            snapshot={"interval_s": None, "wal_bytes": None}))
        self.server, port = replay_server.serve(self.buffer)
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc_common.channel(self.address)
        self.stub = replay_pb2_grpc.ReplayServiceStub(self.channel)
        self._next_prompt = 0

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0).wait()
        self.buffer.close()

    def insert(self, arrow_ipc: bytes, schema_version: int = SCHEMA_VERSION, batch_id: int = 7):
        """One Insert stream with one request; returns the response (raises ``grpc.RpcError``)."""
        request = replay_pb2.InsertRequest(schema_version=schema_version, batch_id=batch_id, arrow_ipc=arrow_ipc)
        return next(iter(self.stub.Insert(iter([request]), timeout=10)))

    def insert_fresh_group(self) -> replay_pb2.InsertResponse:
        """Insert a valid 4-row group of a prompt index never used before (accepted == 4 when healthy)."""
        self._next_prompt += 1
        return self.insert(to_ipc(group_table(self._next_prompt)))

    def info(self) -> dict:
        """Every Info field that only an operation can change, as ``{name: value}``."""
        resp = self.stub.Info(replay_pb2.InfoRequest(), timeout=10)
        return {f.name: v for f, v in resp.ListFields() if f.name not in _MOVING}

    def healthy(self) -> bool:
        return grpc_common.check_health(self.address, replay_server.SERVICE_NAME)


def assert_rejected(replay: ReplayUnderTest, call, names: str) -> grpc.RpcError:
    """``call()`` must fail with a code in ``NAMED_CODES`` whose message contains ``names``; Info is
    unchanged, and the server still answers a health check. Returns the error."""
    before = replay.info()
    try:
        call()
    except grpc.RpcError as exc:
        err = exc
    else:
        raise AssertionError(f"accepted; expected a status naming {names!r}")
    assert err.code() in NAMED_CODES, f"{err.code().name}: {err.details()}"
    assert names in err.details(), f"{err.code().name}: {err.details()!r} does not name {names!r}"
    assert replay.info() == before, "a rejected input changed replay's state"
    assert replay.healthy()
    return err
