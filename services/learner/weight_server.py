"""WeightService servicer: streams ``learner.publisher.WeightPublisher`` versions as checksummed chunks.

Served by ``grpc.aio`` (``services.common.aio_server``): an open stream holds no thread, so the number of
subscribers never starves health checks or ``Latest`` (the threaded server tied one of its 16 threads to each).

Each Subscribe stream serializes its own ``WeightChunk`` messages as it sends them (``serialize_chunk``:
protobuf for the small fields, one copy of the chunk's bytes) and writes them as bytes (``_serialize``
passes bytes through). grpc copies every message into its own buffer per stream anyway, so a per-stream
message costs one more copy into memory that is freed and reused chunk after chunk, where a cache of
serialized messages shared by all streams would hold a second copy of the whole version (283 MB for
SmolLM2-135M's size, 2 bytes per parameter) in freshly faulted pages for as long as it is the newest.
"""

from __future__ import annotations

import asyncio

import structlog

from gyre.faults import fault_point
from gyre.learner.delta_versions import DeltaVersion, relative_version
from gyre.learner.publisher import WeightPublisher
from gyre.services.learner.weight_group import GroupMembers
from gyre.proto import weights_pb2
from gyre.proto.tensor_chunks import iter_chunks
from gyre.proto.manifest import CHECKSUM_KIND
from gyre.proto.trajectory import SCHEMA_VERSION
from gyre.services.common import grpc_common
from gyre.services.common.aio_server import AioServer
from gyre.services.common.weight_stream import (SERVICE_NAME, WRITE_TIMEOUT_S, WeightStreamServicer, add_servicer,
                                                serve_stream)
from gyre.services.common.security import SecurityConfig

log = structlog.get_logger("weights")
CHUNK_BYTES = 4 * 1024 * 1024
__all__ = ["CHUNK_BYTES", "SERVICE_NAME", "WRITE_TIMEOUT_S", "AioServer", "WeightServicer", "add_servicer", "serve",
           "serialize_chunk"]


class WeightServicer(WeightStreamServicer):
    """Each Subscribe stream sends every newest version greater than what the subscriber has.

    Served on a ``grpc.aio`` server (``services.common.aio_server.AioServer``): every method is a coroutine, a
    stream waiting for the next version or for its subscriber to read is suspended, not a thread, so any number of
    subscribers leave health checks and ``Latest`` answered at once. A subscriber that does not take a chunk
    within ``write_timeout_s`` seconds is cut off (``DEADLINE_EXCEEDED``; it resubscribes from the version it
    holds), so a stuck reader pins at most the one version it was being sent, never the learner.
    """

    def __init__(self, publisher: WeightPublisher, chunk_bytes: int = CHUNK_BYTES,
                 write_timeout_s: float = WRITE_TIMEOUT_S, members: GroupMembers | None = None) -> None:
        super().__init__(publisher, write_timeout_s)
        self.publisher = publisher
        self.members = members
        """Where an ``Announce`` stream with an incarnation is registered while it is open (the broadcast
        transport's membership, ``services.learner.weight_group``); ``None``: nobody is."""
        self.chunk_bytes = chunk_bytes
        self._deltas: dict[tuple, asyncio.Future] = {}
        """``(base, version, timeline)`` → the version relative to ``base`` (``learner.delta_versions``), computed
        once in a worker thread for every subscriber on that base; only the newest version's are kept."""
        self.last_delta: DeltaVersion | None = None
        """The newest delta computed (its bytes and density are logged as ``weights_delta``)."""

    async def _offers(self, request, manifest: bool):
        """Yields ``(version, timeline, payload)`` for each newest version new to the subscriber, until close."""
        have, have_timeline = request.have_version, request.have_timeline
        notifier = self.notifier()
        while not self.publisher.closed:
            got = self.publisher.offer(have, have_timeline, manifest=manifest)
            if got is None:
                await notifier.wait(1.0)
                continue
            yield got
            have, have_timeline = got[0], got[1]

    async def _relative(self, base: tuple[int, int] | None, version: int, timeline: int, tensors):
        """``(tensors to send, the base they are relative to or None)`` for a subscriber holding ``base``: sparse
        deltas when the publisher still has ``base`` and they save bytes, else the version whole."""
        base_tensors = self.publisher.encoded(*base) if base is not None and base != (version, timeline) else None
        if base_tensors is None:
            return tensors, None
        key = (base, version, timeline)
        future = self._deltas.get(key)
        if future is None:
            self._deltas = {k: f for k, f in self._deltas.items() if k[1:] == (version, timeline)}
            future = self._deltas[key] = asyncio.ensure_future(
                asyncio.to_thread(relative_version, base_tensors, tensors))
            future.add_done_callback(lambda f, key=key: self._log_delta(key, f))
        try:
            delta = await asyncio.shield(future)
        except Exception:  # logged by _log_delta; the version goes whole
            return tensors, None
        return (tensors, None) if delta is None else (delta.tensors, base)

    def _log_delta(self, key, future: asyncio.Future) -> None:
        if future.cancelled():
            return
        if future.exception() is not None:
            log.error("weights_delta_failed", base=key[0], version=key[1], error=repr(future.exception())[:300])
            return
        delta = future.result()
        if delta is not None:
            self.last_delta = delta
        log.info("weights_delta", base=key[0], version=key[1], sent=delta is not None,
                 changed_fraction=None if delta is None else round(delta.changed_fraction, 5),
                 delta_bytes=None if delta is None else delta.delta_bytes,
                 full_bytes=None if delta is None else delta.full_bytes)

    async def Subscribe(self, request, context):
        log.info("subscriber_joined", subscriber=request.subscriber, have_version=request.have_version,
                 have_timeline=request.have_timeline)
        base = (request.base_version, request.base_timeline) if request.HasField("base_version") else None
        async for version, timeline, tensors in self._offers(request, manifest=False):
            send, relative_to = await self._relative(base, version, timeline, tensors)
            chunks = iter_chunks(version, send, self.chunk_bytes, timeline=timeline, base=relative_to)
            for i, chunk in enumerate(chunks):
                if i == 1:  # the first chunk of a new version is out, the rest not yet
                    fault_point("learner.publish.mid_stream")
                await self._write(context, serialize_chunk(chunk))
            base = (version, timeline)

    async def Announce(self, request, context):
        log.info("announce_subscriber_joined", subscriber=request.subscriber, have_version=request.have_version,
                 have_timeline=request.have_timeline, incarnation=request.incarnation)
        member = self.members is not None and bool(request.incarnation)
        if member:
            self.members.add(request.incarnation, request.subscriber)
            # the RPC's end, however it ends (also a cancellation the handler does not see while it waits)
            context.add_done_callback(lambda _: self.members.remove(request.incarnation))
        try:
            async for version, timeline, (metas, group) in self._offers(request, manifest=True):
                await self._write(context, weights_pb2.VersionManifest(
                    version=version, checksum_kind=CHECKSUM_KIND, schema_version=SCHEMA_VERSION, timeline=timeline,
                    tensors=[weights_pb2.TensorMeta(name=m.name, dtype=m.dtype, shape=m.shape, nbytes=m.nbytes,
                                                    checksum=m.checksum) for m in metas], group=group))
        finally:
            if member:
                self.members.remove(request.incarnation)

    async def Latest(self, request, context):
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
        timeline=c.timeline, chunk_checksum=c.chunk_checksum, encoding=c.encoding,
        base_version=None if c.base is None else c.base[0],
        base_timeline=0 if c.base is None else c.base[1]).SerializeToString()
    n, length = len(c.data), bytearray()
    while True:
        length.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            break
    return b"".join((head, _DATA_TAG, length, c.data))


def serve(publisher: WeightPublisher, host: str | None = None, port: int = 0,
          security: SecurityConfig | None = None, members: GroupMembers | None = None) -> tuple[AioServer, int]:
    """Start a weight server on ``host:port`` (0 = free port; host defaults to ``security.bind_host``,
    else 127.0.0.1), with TLS and token auth per ``security``; returns ``(server, bound_port)``. ``members``:
    where open ``Announce`` streams register (the broadcast transport, ``services.learner.weight_group``)."""
    host = grpc_common.bind_host(host, security)
    server, port = serve_stream(WeightServicer(publisher, members=members), host, port, security)
    log.info("weights_serving", address=f"{host}:{port}")
    return server, port
