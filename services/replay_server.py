"""ReplayService servicer: a thin gRPC adapter over ``replay.buffer.TrajectoryBuffer``."""

from __future__ import annotations

import grpc
import structlog

from proto import replay_pb2, replay_pb2_grpc
from proto.trajectory import SCHEMA_VERSION, SchemaError, from_ipc, to_ipc
from replay.buffer import TrajectoryBuffer, UnknownLeaseError
from services import grpc_common

log = structlog.get_logger("replay")
SERVICE_NAME = "gyre.replay.v1.ReplayService"


def _check_schema(version: int, context: grpc.ServicerContext) -> None:
    if version != SCHEMA_VERSION:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"schema_version {version} is not supported; this server speaks {SCHEMA_VERSION}")


class ReplayServicer(replay_pb2_grpc.ReplayServiceServicer):
    """Validates each request at the boundary, then calls the in-process buffer."""

    def __init__(self, buffer: TrajectoryBuffer) -> None:
        self.buffer = buffer

    def Insert(self, request_iterator, context):
        for req in request_iterator:
            _check_schema(req.schema_version, context)
            limit = self.buffer.config.max_batch_bytes
            if len(req.arrow_ipc) > limit:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"batch {req.batch_id}: arrow_ipc is {len(req.arrow_ipc)} bytes; limit is {limit}")
            try:
                result = self.buffer.insert(from_ipc(req.arrow_ipc))
            except SchemaError as exc:
                log.warning("insert_rejected", batch_id=req.batch_id, error=str(exc))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"batch {req.batch_id}: {exc}")
            yield replay_pb2.InsertResponse(batch_id=req.batch_id, accepted=result.accepted,
                                            duplicates=result.duplicates, dropped_stale=result.dropped_stale)

    def Sample(self, request, context):
        _check_schema(request.schema_version, context)
        if request.num_groups < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_groups ({request.num_groups}) must be >= 1")
        if not 0 <= request.timeout_s <= 600:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s ({request.timeout_s}) must be in [0, 600]")
        got = self.buffer.sample(request.num_groups, request.learner_version, request.timeout_s, request.consumer)
        if got is None:
            return replay_pb2.SampleResponse()
        lease_id, table = got
        return replay_pb2.SampleResponse(lease_id=lease_id, arrow_ipc=to_ipc(table), num_groups=request.num_groups)

    def Ack(self, request, context):
        try:
            return replay_pb2.AckResponse(acked=self.buffer.ack(list(request.lease_ids)))
        except UnknownLeaseError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))

    def Release(self, request, context):
        try:
            return replay_pb2.ReleaseResponse(released=self.buffer.release(list(request.lease_ids)))
        except UnknownLeaseError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))

    def LeasePrompts(self, request, context):
        if request.count > 4096:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"count ({request.count}) must be <= 4096")
        if request.ttl_s < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ttl_s ({request.ttl_s}) must be >= 0")
        leases = self.buffer.lease_prompts(request.consumer, request.count, request.ttl_s or None)
        return replay_pb2.LeasePromptsResponse(
            prompts=[replay_pb2.PromptLease(prompt_index=i, attempt=a) for i, a in leases])

    def Info(self, request, context):
        return replay_pb2.InfoResponse(schema_version=SCHEMA_VERSION, **self.buffer.info())


def serve(buffer: TrajectoryBuffer, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.Server, int]:
    """Start a replay server on ``host:port`` (0 = free port); returns ``(server, bound_port)``."""
    server, health_servicer = grpc_common.make_server()
    replay_pb2_grpc.add_ReplayServiceServicer_to_server(ReplayServicer(buffer), server)
    port = grpc_common.start(server, health_servicer, SERVICE_NAME, host, port)
    log.info("replay_serving", address=f"{host}:{port}")
    return server, port
