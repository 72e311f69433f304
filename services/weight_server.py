"""WeightService servicer: streams ``learner.publisher.WeightPublisher`` versions as checksummed chunks.

Each version's ``WeightChunk`` messages are serialized once, on demand, into a cache that every
Subscribe stream shares (``_WireVersion``): N subscribers cost one protobuf encoding, not N, and the
servicer yields the serialized bytes as they are (``_serialize`` passes bytes through).
"""

from __future__ import annotations

import threading

import grpc
import structlog

from faults import fault_point
from learner.publisher import WeightPublisher
from proto import weights_pb2, weights_pb2_grpc
from proto.tensor_chunks import CHECKSUM_KIND, iter_chunks
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
        self._wire: _WireVersion | None = None
        self._wire_lock = threading.Lock()

    def _wire_for(self, version: int, tensors) -> "_WireVersion":
        with self._wire_lock:
            if self._wire is None or self._wire.version != version:
                self._wire = _WireVersion(version, iter_chunks(version, tensors, self.chunk_bytes))
            return self._wire

    def Subscribe(self, request, context):
        have = request.have_version
        log.info("subscriber_joined", subscriber=request.subscriber, have_version=have)
        while context.is_active():
            got = self.publisher.wait_newer(have, timeout_s=1.0)
            if got is None:
                continue
            version, tensors = got
            for i, msg in enumerate(self._wire_for(version, tensors)):
                if i == 1:  # the first chunk of a new version is out, the rest not yet
                    fault_point("learner.publish.mid_stream")
                yield msg
            have = version

    def Announce(self, request, context):
        have = request.have_version
        log.info("announce_subscriber_joined", subscriber=request.subscriber, have_version=have)
        while context.is_active():
            got = self.publisher.wait_newer_manifest(have, timeout_s=1.0)
            if got is None:
                continue
            version, metas = got
            yield weights_pb2.VersionManifest(
                version=version, checksum_kind=CHECKSUM_KIND, schema_version=SCHEMA_VERSION,
                tensors=[weights_pb2.TensorMeta(name=m.name, dtype=m.dtype, shape=m.shape, nbytes=m.nbytes,
                                                checksum=m.checksum) for m in metas])
            have = version

    def Latest(self, request, context):
        return weights_pb2.LatestResponse(version=self.publisher.version)


class _WireVersion:
    """Serialized ``WeightChunk`` messages of one version, produced once by whichever stream is ahead
    and replayed to every other stream (bytes, in order)."""

    def __init__(self, version: int, chunks) -> None:
        self.version = version
        self._chunks = chunks
        self._wire: list[bytes] = []
        self._done = False
        self._lock = threading.Lock()

    def __iter__(self):
        i = 0
        while True:
            with self._lock:
                if i == len(self._wire) and not self._done:
                    c = next(self._chunks, None)
                    if c is None:
                        self._done = True
                    else:
                        self._wire.append(serialize_chunk(c))
                if i == len(self._wire):
                    return
                msg = self._wire[i]
            yield msg
            i += 1


_DATA_TAG = bytes([(6 << 3) | 2])  # WeightChunk.data: field 6, wire type 2 (length-delimited)


def serialize_chunk(c) -> bytes:
    """``WeightChunk`` wire bytes of a ``TensorChunk`` with one copy of its data: the other fields are
    serialized by protobuf, then field 6 (``data``) is appended as tag + varint length + raw bytes
    (protobuf parses concatenated fields as one message, so the result equals ``SerializeToString``'s
    up to field order)."""
    head = weights_pb2.WeightChunk(
        version=c.version, name=c.name, dtype=c.dtype, shape=c.shape, offset=c.offset, nbytes=c.nbytes,
        last_of_tensor=c.last_of_tensor, crc32=c.crc32, last_of_version=c.last_of_version,
        num_tensors=c.num_tensors, schema_version=SCHEMA_VERSION).SerializeToString()
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
