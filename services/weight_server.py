"""WeightService servicer: streams ``learner.publisher.WeightPublisher`` versions as checksummed chunks."""

from __future__ import annotations

import grpc
import structlog

from learner.publisher import WeightPublisher
from proto import weights_pb2, weights_pb2_grpc
from proto.tensor_chunks import iter_chunks
from proto.trajectory import SCHEMA_VERSION
from services import grpc_common
from services.security import SecurityConfig

log = structlog.get_logger("weights")
SERVICE_NAME = "gyre.weights.v1.WeightService"
CHUNK_BYTES = 4 * 1024 * 1024


class WeightServicer(weights_pb2_grpc.WeightServiceServicer):
    """Each Subscribe stream sends every newest version greater than what the subscriber has."""

    def __init__(self, publisher: WeightPublisher, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.publisher = publisher
        self.chunk_bytes = chunk_bytes

    def Subscribe(self, request, context):
        have = request.have_version
        log.info("subscriber_joined", subscriber=request.subscriber, have_version=have)
        while context.is_active():
            got = self.publisher.wait_newer(have, timeout_s=1.0)
            if got is None:
                continue
            version, tensors = got
            for c in iter_chunks(version, tensors, self.chunk_bytes):
                yield weights_pb2.WeightChunk(
                    version=c.version, name=c.name, dtype=c.dtype, shape=c.shape, offset=c.offset,
                    data=c.data, nbytes=c.nbytes, last_of_tensor=c.last_of_tensor, crc32=c.crc32,
                    last_of_version=c.last_of_version, num_tensors=c.num_tensors, schema_version=SCHEMA_VERSION)
            have = version

    def Latest(self, request, context):
        return weights_pb2.LatestResponse(version=self.publisher.version)


def serve(publisher: WeightPublisher, host: str | None = None, port: int = 0,
          security: SecurityConfig | None = None) -> tuple[grpc.Server, int]:
    """Start a weight server on ``host:port`` (0 = free port; host defaults to ``security.bind_host``,
    else 127.0.0.1), with TLS and token auth per ``security``; returns ``(server, bound_port)``."""
    host = grpc_common.bind_host(host, security)
    server, health_servicer = grpc_common.make_server(security=security)
    weights_pb2_grpc.add_WeightServiceServicer_to_server(WeightServicer(publisher), server)
    port = grpc_common.start(server, health_servicer, SERVICE_NAME, host, port, security)
    log.info("weights_serving", address=f"{host}:{port}")
    return server, port
