"""What every server of ``WeightService`` shares — the learner's (``services.learner.weight_server``) and each
rollout's relay (``services.rollout.transport.relay``): the service name, the servicer base that waits for new
versions on ``asyncio`` and drops a subscriber that stops reading, and the registration that passes
``Subscribe``'s pre-serialized chunks through as bytes.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

import grpc
import structlog

from gyre.proto import weights_pb2, weights_pb2_grpc
from gyre.services.common.aio_server import AioServer, AsyncNotifier
from gyre.services.common.security import SecurityConfig

log = structlog.get_logger("weights")
SERVICE_NAME = "gyre.weights.v1.WeightService"
WRITE_TIMEOUT_S = 120.0
"""Seconds a Subscribe/Announce stream waits for its subscriber to take one message before dropping it."""


class VersionSource(Protocol):
    """What a weight stream follows (``learner.publisher.WeightPublisher``, a relay's ``RelayCache``)."""

    def add_listener(self, callback: Callable[[], None]) -> None: ...


class WeightStreamServicer(weights_pb2_grpc.WeightServiceServicer):
    """Base of the ``WeightService`` servicers, served on ``grpc.aio``: a stream waiting for a new version
    (``notifier``) or for its subscriber to read (``_write``) is a suspended coroutine, never a thread.

    Args:
        source: told to call back on every new version (``add_listener``).
        write_timeout_s: a subscriber that takes no message for this long is cut off (``DEADLINE_EXCEEDED``; it
            resubscribes from what it holds), so a stuck reader pins at most the version it was being sent.
    """

    def __init__(self, source: VersionSource, write_timeout_s: float = WRITE_TIMEOUT_S) -> None:
        self.source = source
        self.write_timeout_s = write_timeout_s
        self._notifier: AsyncNotifier | None = None

    def notifier(self) -> AsyncNotifier:
        """The running loop's ``AsyncNotifier`` of new versions (registered with the source on first use)."""
        if self._notifier is None:
            self._notifier = AsyncNotifier(asyncio.get_running_loop())
            self.source.add_listener(self._notifier.notify)
        return self._notifier

    async def _write(self, context, msg) -> None:
        try:
            await asyncio.wait_for(context.write(msg), self.write_timeout_s)
        except asyncio.TimeoutError:
            log.warning("subscriber_not_reading", peer=context.peer(), timeout_s=self.write_timeout_s)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"subscriber took no chunk for {self.write_timeout_s}s; stream dropped")


def _serialize(msg) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def add_servicer(servicer: WeightStreamServicer, server: AioServer) -> None:
    """``add_WeightServiceServicer_to_server`` with Subscribe's responses passed through as bytes."""
    handlers = {
        "Subscribe": grpc.unary_stream_rpc_method_handler(
            servicer.Subscribe, request_deserializer=weights_pb2.SubscribeRequest.FromString,
            response_serializer=_serialize),
        "Announce": grpc.unary_stream_rpc_method_handler(
            servicer.Announce, request_deserializer=weights_pb2.SubscribeRequest.FromString,
            response_serializer=weights_pb2.VersionManifest.SerializeToString),
        "Latest": grpc.unary_unary_rpc_method_handler(
            servicer.Latest, request_deserializer=weights_pb2.LatestRequest.FromString,
            response_serializer=weights_pb2.LatestResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def serve_stream(servicer: WeightStreamServicer, host: str, port: int = 0,
                 security: SecurityConfig | None = None) -> tuple[AioServer, int]:
    """Serve ``servicer`` on a new ``AioServer`` at ``host:port`` (0: a free port), TLS and token per ``security``;
    returns ``(server, bound_port)``; a server that fails to start is stopped before the error propagates."""
    server = AioServer(security)
    add_servicer(servicer, server)
    try:
        return server, server.start(SERVICE_NAME, host, port)
    except BaseException:
        server.stop(0)
        raise
