"""ReplayService servicer: a thin gRPC adapter over ``replay.buffer.TrajectoryBuffer``.

Validation at the boundary, error mapping to status codes (each message names the field and value),
and Insert pipelining: a reader thread per stream hands requests to the ingest stage
(``services.replay.ingest``), whose one thread stores what every stream queued in batches, while the
response to request N waits for its WAL fsync. Responses stay in request order.
"""

from __future__ import annotations

import contextlib

import sys
import threading
import time

import grpc
import structlog

from grpc_health.v1 import health_pb2

from gyre.proto import replay_pb2, replay_pb2_grpc
from gyre.proto.trajectory import SCHEMA_VERSION, to_ipc
from gyre.replay.buffer import TrajectoryBuffer, UnknownLeaseError
from gyre.replay.memory import tune_malloc
from gyre.replay.wal import WalError
from gyre.services.common import grpc_common
from gyre.services.common.security import SecurityConfig
from gyre.services.replay.ingest import END, IngestStage, Stream, check_schema
from gyre.services.replay.ingest import Abort as _Abort

log = structlog.get_logger("replay")
SERVICE_NAME = "gyre.replay.v1.ReplayService"
_GIL_SWITCH_S = 0.001
"""GIL switch interval of a replay process (CPython's default is 5 ms): a thread that holds the GIL in
pure Python (a snapshot building its group table, a restore, a big Info) makes every RPC thread
waiting for it wait up to this long, so insert and sample tail latency follow it."""


@contextlib.contextmanager
def _statuses(context):
    """Turn ``_Abort`` and the buffer's errors raised inside into status codes."""
    try:
        yield
    except _Abort as exc:
        context.abort(exc.code, exc.message)
    except UnknownLeaseError as exc:
        context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
    except WalError as exc:
        log.error("replay_wal_failed", error=str(exc))
        context.abort(grpc.StatusCode.UNAVAILABLE, f"replay cannot persist: {exc}")


def _aborting(fn):
    """Run a unary handler under ``_statuses``."""
    def handler(self, request, context):
        with _statuses(context):
            return fn(self, request, context)
    handler.__name__ = fn.__name__
    return handler


def _aborting_stream(fn):
    """Run a server-streaming handler under ``_statuses`` (errors raised while it yields, too)."""
    def handler(self, request, context):
        with _statuses(context):
            yield from fn(self, request, context)
    handler.__name__ = fn.__name__
    return handler


class ReplayServicer(replay_pb2_grpc.ReplayServiceServicer):
    """Validates each request at the boundary, then calls the in-process buffer."""

    def __init__(self, buffer: TrajectoryBuffer) -> None:
        self.buffer = buffer
        self.ingest = IngestStage(buffer)

    # ---- Insert (pipelined, stored in batches) ---------------------------------------------------------
    def Insert(self, request_iterator, context):
        """A reader thread hands each request to the ingest stage (``services.replay.ingest``), which
        stores requests of every stream in batches; this handler answers them in order once durable,
        so one stream gets group commit too (request N+1 is stored while N waits for its fsync)."""
        stream = Stream()

        def read() -> None:
            try:
                for req in request_iterator:
                    if stream.failed:
                        break
                    remaining = context.time_remaining()
                    stream.received.append(time.monotonic())
                    self.ingest.submit(stream, req, None if remaining is None else time.monotonic() + remaining)
            except grpc.RpcError as exc:  # the stream broke (client gone); nothing more to store
                self.ingest.submit(stream, _Abort(grpc.StatusCode.CANCELLED, f"insert stream ended: {exc}"))
            except Exception as exc:  # a bug: say so (INTERNAL), never CANCELLED, which clients may retry
                log.exception("insert_failed")
                self.ingest.submit(stream, _Abort(grpc.StatusCode.INTERNAL, f"insert failed: {type(exc).__name__}: {exc}"))
            finally:
                self.ingest.submit(stream, END)

        threading.Thread(target=read, name="replay-insert-reader", daemon=True).start()
        while (item := stream.answers.get()) is not END:
            if isinstance(item, _Abort):
                context.abort(item.code, item.message)
            lsn, response = item
            try:
                with self.buffer.foreground():
                    self.buffer.wait_durable(lsn)
            except WalError as exc:
                log.error("replay_wal_failed", error=str(exc))
                context.abort(grpc.StatusCode.UNAVAILABLE, f"replay cannot persist: {exc}")
            if stream.received:
                self.buffer.latency["insert"].add(time.monotonic() - stream.received.popleft())
            yield response

    # ---- unary RPCs ---------------------------------------------------------------------------------
    @_aborting
    def Sample(self, request, context):
        got = self._sample(request)
        if got is None:
            return replay_pb2.SampleResponse()
        lease_id, table = got
        return replay_pb2.SampleResponse(lease_id=lease_id, arrow_ipc=to_ipc(table), num_groups=request.num_groups)

    @_aborting_stream
    def SampleStream(self, request, context):
        got = self._sample(request)
        if got is None:
            return
        lease_id, table = got
        yield replay_pb2.SampleResponse(lease_id=lease_id, num_groups=request.num_groups)
        for part in slices(table, SAMPLE_SLICE_BYTES):
            yield replay_pb2.SampleResponse(arrow_ipc=to_ipc(part))

    def _sample(self, request):
        """``buffer.sample`` for a ``SampleRequest``, validated (``INVALID_ARGUMENT`` naming the bad field)."""
        check_schema(request.schema_version)
        if request.num_groups < 1:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_groups ({request.num_groups}) must be >= 1")
        if not 0 <= request.timeout_s <= 600:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s ({request.timeout_s}) must be in [0, 600]")
        try:
            return self.buffer.sample(request.num_groups, request.learner_version, request.timeout_s,
                                      request.consumer, prompt_indices=list(request.prompt_indices) or None,
                                      request_id=request.request_id)
        except ValueError as exc:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc

    @_aborting
    def Ack(self, request, context):
        return replay_pb2.AckResponse(acked=self.buffer.ack(list(request.lease_ids)))

    @_aborting
    def Release(self, request, context):
        return replay_pb2.ReleaseResponse(released=self.buffer.release(list(request.lease_ids)))

    @_aborting
    def Rejoin(self, request, context):
        try:
            return replay_pb2.RejoinResponse(released=self.buffer.rejoin(request.consumer, request.learner_version,
                                                                         request.timeline))
        except ValueError as exc:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc

    @_aborting
    def LeasePrompts(self, request, context):
        if request.count > 4096:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"count ({request.count}) must be <= 4096")
        if not request.ttl_s >= 0:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"ttl_s ({request.ttl_s}) must be >= 0")
        t0 = time.monotonic()
        leases = self.buffer.lease_prompts(request.consumer, request.count, request.ttl_s or None,
                                          below=request.below_prompt_index or None,
                                          max_ready=request.max_ready_groups or None,
                                          policy_version=request.policy_version
                                          if request.HasField("policy_version") else None)
        self.buffer.latency["lease_prompts"].add(time.monotonic() - t0)
        return replay_pb2.LeasePromptsResponse(
            prompts=[replay_pb2.PromptLease(prompt_index=i, attempt=a) for i, a in leases],
            budget=self.buffer.prompts.budget())

    @_aborting
    def UpdatePriorities(self, request, context):
        try:
            updated, unknown = self.buffer.update_priorities(list(request.group_ids), list(request.priorities))
        except ValueError as exc:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        return replay_pb2.UpdatePrioritiesResponse(updated=updated, unknown_group_ids=unknown)

    @_aborting
    def Snapshot(self, request, context):
        if self.buffer.durability is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, "replay runs without a directory (dir is unset)")
        path = self.buffer.snapshot()
        return replay_pb2.SnapshotResponse(path=str(path or ""))

    def Info(self, request, context):
        info = self.buffer.info()
        return replay_pb2.InfoResponse(schema_version=SCHEMA_VERSION, **info)


SAMPLE_SLICE_BYTES = 64 * 1024 * 1024
"""Arrow bytes of rows per ``SampleStream`` message (one row may exceed it)."""


def slices(table, slice_bytes: int):
    """``table`` as consecutive row slices of about ``slice_bytes`` Arrow bytes each (at least one row each)."""
    rows = table.num_rows
    per = max(1, rows * slice_bytes // max(1, table.nbytes))
    return [table.slice(start, per) for start in range(0, rows, per)]


def serve(buffer: TrajectoryBuffer, host: str | None = None, port: int = 0,
          security: SecurityConfig | None = None) -> tuple[grpc.Server, int]:
    """Start a replay server on ``host:port`` (0 = free port; host defaults to ``security.bind_host``,
    else 127.0.0.1), with TLS and token auth per ``security``; returns ``(server, bound_port)``.

    Health: SERVING once started; NOT_SERVING (both ``""`` and the service name) from the moment the
    WAL fails (disk full, I/O error) until the process is restarted — a failed log is never written
    again, so every insert and every other change answers UNAVAILABLE naming the error meanwhile.
    """
    sys.setswitchinterval(_GIL_SWITCH_S)
    tune_malloc()  # transient 0.5 MB message buffers reuse freed memory instead of faulting in fresh pages
    host = grpc_common.bind_host(host, security)
    server, health_servicer = grpc_common.make_server(security=security)
    replay_pb2_grpc.add_ReplayServiceServicer_to_server(ReplayServicer(buffer), server)
    port = grpc_common.start(server, health_servicer, SERVICE_NAME, host, port, security)
    if buffer.durability is not None:
        def not_serving(failure: str) -> None:
            log.error("replay_not_serving", reason=failure)
            for name in ("", SERVICE_NAME):
                health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

        buffer.durability.add_failure_listener(not_serving)
    log.info("replay_serving", address=f"{host}:{port}", dir=buffer.config.dir)
    return server, port
