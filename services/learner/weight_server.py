"""WeightService servicer: streams ``learner.publisher.WeightPublisher`` versions as checksummed chunks.

Each Subscribe stream serializes its own ``WeightChunk`` messages as it sends them (``serialize_chunk``:
protobuf for the small fields, one copy of the chunk's bytes) and yields them as bytes (``_serialize``
passes bytes through). grpc copies every message into its own buffer per stream anyway, so a per-stream
message costs one more copy into memory that is freed and reused chunk after chunk, where a cache of
serialized messages shared by all streams would hold a second copy of the whole version (283 MB for
SmolLM2-135M's size, 2 bytes per parameter) in freshly faulted pages for as long as it is the newest.
"""

from __future__ import annotations

import grpc
import structlog

from gyre.faults import fault_point
from gyre.learner.publisher import WeightPublisher
from gyre.proto import weights_pb2, weights_pb2_grpc
from gyre.proto.tensor_chunks import CHECKSUM_KIND, iter_chunks
from gyre.proto.trajectory import SCHEMA_VERSION
from gyre.services.common import grpc_common
from gyre.services.common.security import SecurityConfig

log = structlog.get_logger("weights")
SERVICE_NAME = "gyre.weights.v1.WeightService"
CHUNK_BYTES = 4 * 1024 * 1024


class WeightServicer(weights_pb2_grpc.WeightServiceServicer):
    """Each Subscribe stream sends every newest version greater than what the subscriber has."""

    def __init__(self, publisher: WeightPublisher, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.publisher = publisher
        self.chunk_bytes = chunk_bytes

    def Subscribe(self, request, context):
        have, have_timeline = request.have_version, request.have_timeline
        log.info("subscriber_joined", subscriber=request.subscriber, have_version=have, have_timeline=have_timeline)
        while context.is_active():
            got = self.publisher.wait_offer(have, have_timeline, timeout_s=1.0)
            if got is None:
                continue
            version, timeline, tensors = got
            chunks = iter_chunks(version, tensors, self.chunk_bytes, timeline=timeline)
            for i, msg in enumerate(map(serialize_chunk, chunks)):
                if i == 1:  # the first chunk of a new version is out, the rest not yet
                    fault_point("learner.publish.mid_stream")
                yield msg
            have, have_timeline = version, timeline

    def Announce(self, request, context):
        have, have_timeline = request.have_version, request.have_timeline
        log.info("announce_subscriber_joined", subscriber=request.subscriber, have_version=have,
                 have_timeline=have_timeline)
        while context.is_active():
            got = self.publisher.wait_offer(have, have_timeline, timeout_s=1.0, manifest=True)
            if got is None:
                continue
            version, timeline, metas = got
            yield weights_pb2.VersionManifest(
                version=version, checksum_kind=CHECKSUM_KIND, schema_version=SCHEMA_VERSION, timeline=timeline,
                tensors=[weights_pb2.TensorMeta(name=m.name, dtype=m.dtype, shape=m.shape, nbytes=m.nbytes,
                                                checksum=m.checksum) for m in metas])
            have, have_timeline = version, timeline

    def Latest(self, request, context):
        version, timeline = self.publisher.latest()
        return weights_pb2.LatestResponse(version=version, timeline=timeline)


_DATA_TAG = bytes([(6 << 3) | 2])  # WeightChunk.data: field 6, wire type 2 (length-delimited)


def serialize_chunk(c) -> bytes:
    """``WeightChunk`` wire bytes of a ``TensorChunk`` with one copy of its data: the other fields are
    serialized by protobuf, then field 6 (``data``) is appended as tag + varint length + raw bytes
    (protobuf parses concatenated fields as one message, so the result equals ``SerializeToString``'s
    up to field order)."""
    head = weights_pb2.WeightChunk(
        version=c.version, name=c.name, dtype=c.dtype, shape=c.shape, offset=c.offset, nbytes=c.nbytes,
        last_of_tensor=c.last_of_tensor, checksum=c.checksum, last_of_version=c.last_of_version,
        num_tensors=c.num_tensors, schema_version=SCHEMA_VERSION, checksum_kind=c.checksum_kind,
        timeline=c.timeline).SerializeToString()
    n, length = len(c.data), bytearray()
    while True:
        length.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            break
    return b"".join((head, _DATA_TAG, length, c.data))


def _serialize(msg) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def add_servicer(servicer: WeightServicer, server: grpc.Server) -> None:
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


def serve(publisher: WeightPublisher, host: str | None = None, port: int = 0,
          security: SecurityConfig | None = None) -> tuple[grpc.Server, int]:
    """Start a weight server on ``host:port`` (0 = free port; host defaults to ``security.bind_host``,
    else 127.0.0.1), with TLS and token auth per ``security``; returns ``(server, bound_port)``."""
    host = grpc_common.bind_host(host, security)
    server, health_servicer = grpc_common.make_server(security=security)
    add_servicer(WeightServicer(publisher), server)
    port = grpc_common.start(server, health_servicer, SERVICE_NAME, host, port, security)
    log.info("weights_serving", address=f"{host}:{port}")
    return server, port
