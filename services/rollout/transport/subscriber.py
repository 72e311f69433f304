"""Weight subscriber: a background thread that follows the learner's newest policy version."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

import grpc
from google.protobuf.message import DecodeError
import structlog
import torch

from gyre.proto import weights_pb2, weights_pb2_grpc
from gyre.utils.retry import reconnect_forever
from gyre.proto.tensor_chunks import ChunkAssembler, ChunkError, TensorChunk
from gyre.proto.timeline import SHARED, is_new
from gyre.services.common import grpc_common
from gyre.services.common.security import SecurityConfig

log = structlog.get_logger("weights")

OnVersion = Callable[[int, list[tuple[str, torch.Tensor]], int], None]

if TYPE_CHECKING:
    from gyre.services.rollout.transport.relay import RelayCache


class StreamThread:
    """A background thread running ``self._run`` over one gRPC stream at a time (``self._call``): ``start()``
    starts it; ``stop()`` sets ``self._stop`` (ending a backoff wait), cancels the stream in flight and joins the
    thread (at most 10 s). Shared by the weight subscriber and the NCCL transport's announce stream."""

    def _init_stream_thread(self, thread_name: str) -> None:
        self._stop = threading.Event()
        self._call = None
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self):
        self._thread.start()
        return self

    def _opened(self, call):
        """Record ``call`` as the stream in flight; cancel it at once if ``stop`` came first (``stop`` sets the
        event before it cancels ``self._call``, so a call opened meanwhile is cancelled by one side or the other)."""
        self._call = call
        if self._stop.is_set():
            call.cancel()
        return call

    def stop(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        self._thread.join(timeout=10)


class WeightSubscriber(StreamThread):
    """Streams versions new to ``(have_version, have_timeline)`` and hands each verified one to ``on_version``.

    Every chunk must arrive within ``chunk_timeout_s`` seconds of the previous one once a version
    started; a stalled or broken stream is cancelled and retried with exponential backoff
    (``backoff_s`` up to ``max_backoff_s``: ``utils.retry.reconnect_forever``), so a dead learner never hangs
    the rollout; ``stop()`` ends a backoff wait at once. Versions only move forward within a timeline: a
    version is delivered when it is newer than the last delivered one or of another timeline
    (``proto.timeline.is_new``: the learner rewound), else ignored.

    Args:
        address: ``host:port`` of the learner's WeightService.
        on_version: called in the subscriber thread with ``(version, [(name, tensor)], timeline)``; if it
            raises, the version is not counted as delivered, the stream is retried after backoff and
            the newest version is fetched again (the engine keeps serving the old one meanwhile).
        have_version: newest version the caller already has (-1 for none).
        have_timeline: its timeline (``proto.timeline``; ``SHARED`` for none or the initial weights).
        security: TLS and token settings for the channel (``None``: plaintext, no token).
        fallbacks: where to fetch a version when ``address`` (a parent relay, ``services.rollout.transport.relay``)
            failed — broke, stalled, or sent a chunk that failed its checksum: the next attempt goes to
            ``fallbacks[0]`` (e.g. the grandparent relay), a failure there to ``fallbacks[1]`` and so on (the last
            is the learner); after one version from a fallback the subscriber goes back to ``address``.
        relay: a ``RelayCache`` fed every chunk this subscriber checked, as it arrives (this rollout relays them).
    """

    def __init__(self, address: str, on_version: OnVersion, have_version: int = -1, name: str = "",
                 chunk_timeout_s: float = 30.0, backoff_s: float = 0.5, max_backoff_s: float = 10.0,
                 security: SecurityConfig | None = None, have_timeline: int = SHARED,
                 fallbacks: Sequence[str] = (), relay: "RelayCache | None" = None) -> None:
        self.address = address
        self.upstreams = (address, *fallbacks)
        """``address``, then the fallbacks in order."""
        self.relay = relay
        self._level = 0
        """Index in ``upstreams`` of the next attempt."""
        self.fallback_versions = 0
        """Versions fetched from a fallback because ``address`` failed."""
        self.base: tuple[int, int, dict[str, bytes]] | None = None
        """``(version, timeline, {name: raw bytes})`` of the newest complete version received: what a sparse delta
        (``proto.sparse_delta``) is applied to; dropped after a refused chunk, so the next attempt asks for a whole
        version."""
        self.security = security
        self.on_version = on_version
        self.have_version, self.have_timeline = have_version, have_timeline
        self.name = name
        self.chunk_timeout_s = chunk_timeout_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.errors = 0
        self._init_stream_thread(f"weights-{name}")

    def _run(self) -> None:
        broken = (grpc.RpcError, ChunkError, TimeoutError, VersionRefusedError)
        reconnect_forever(self._stream_once, self._stop, broken, self.backoff_s, self.max_backoff_s, self._broken)

    def _broken(self, exc: BaseException, retry_in_s: float) -> None:
        self.errors += 1
        if isinstance(exc, ChunkError):
            self.base = None  # e.g. a delta against the wrong base: the next version comes whole
        self._to_relay("abandon")
        upstream = self._upstream()
        self._level = min(self._level + 1, len(self.upstreams) - 1)  # the next attempt: one level further up
        log.warning("weight_stream_broken", subscriber=self.name, upstream=upstream, error=str(exc)[:300],
                    kind=type(exc).__name__, retry_in_s=retry_in_s, next_upstream=self._upstream())

    def _to_relay(self, method: str, *args) -> None:
        """Hand the relay what this subscriber received; a relay that fails is turned off (logged), never the
        rollout's own weights."""
        if self.relay is None:
            return
        try:
            getattr(self.relay, method)(*args)
        except Exception as exc:
            log.error("weight_relay_failed_turned_off", subscriber=self.name, error=f"{type(exc).__name__}: {exc}")
            self.relay = None

    def _upstream(self) -> str:
        return self.upstreams[self._level]

    def _stream_once(self) -> None:
        on_fallback = self._level > 0
        with grpc_common.channel(self._upstream(), self.security) as ch:
            subscribe = ch.unary_stream(SUBSCRIBE_METHOD,
                                        request_serializer=weights_pb2.SubscribeRequest.SerializeToString,
                                        response_deserializer=None)  # raw bytes: a relay forwards them as they are
            base = self.base
            self._opened(subscribe(weights_pb2.SubscribeRequest(
                have_version=self.have_version, have_timeline=self.have_timeline, subscriber=self.name,
                base_version=None if base is None else base[0], base_timeline=0 if base is None else base[1])))
            watchdog = _Watchdog(self._call, self.chunk_timeout_s)
            assembler = ChunkAssembler(base=base)
            try:
                for raw in self._call:
                    watchdog.kick(in_version=True)
                    msg = parse_chunk(raw)
                    done = assembler.feed(msg)
                    self._to_relay("add", msg.version, msg.timeline, raw, msg.base)
                    if done is None:
                        continue
                    watchdog.kick(in_version=False)
                    self._to_relay("complete")
                    version, tensors = done
                    self.base = assembler.base = (version, msg.timeline, assembler.raw)
                    if is_new(version, msg.timeline, self.have_version, self.have_timeline):
                        self._deliver(version, tensors, msg.timeline)
                    if on_fallback:  # one version from the fallback, then back to the parent
                        self.fallback_versions += 1
                        self._level = 0
                        return
            finally:
                watchdog.stop()
            if watchdog.fired:
                raise TimeoutError(f"no weight chunk for {self.chunk_timeout_s}s; stream abandoned")


    def _deliver(self, version: int, tensors, timeline: int) -> None:
        try:
            self.on_version(version, tensors, timeline)
        except Exception as exc:  # the engine refused it (bad weights): keep the old version, retry later
            raise VersionRefusedError(f"version {version} refused by on_version: {exc!r}") from exc
        self.have_version, self.have_timeline = version, timeline


def latest_version(address: str, timeout_s: float, security: SecurityConfig | None = None) -> int | None:
    """``WeightService.Latest`` with a deadline of ``timeout_s`` seconds: the newest published version
    (-1 before the first), or ``None`` when the learner did not answer in time."""
    with grpc_common.channel(address, security) as ch:
        try:
            return weights_pb2_grpc.WeightServiceStub(ch).Latest(weights_pb2.LatestRequest(), timeout=timeout_s).version
        except grpc.RpcError as exc:
            log.info("weights_latest_unanswered", address=address, code=str(exc.code()))
            return None


class VersionRefusedError(RuntimeError):
    """``on_version`` raised for a verified version (e.g. the engine refused its names or shapes)."""


SUBSCRIBE_METHOD = "/gyre.weights.v1.WeightService/Subscribe"
_DATA_FIELD = 6  # WeightChunk.data


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw):
            raise ChunkError("malformed WeightChunk: truncated varint")
        b = raw[pos]
        value |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not b & 0x80:
            return value, pos


def parse_chunk(raw: bytes) -> TensorChunk:
    """``WeightChunk`` wire bytes → ``TensorChunk`` whose ``data`` is a zero-copy view of ``raw``.

    The message is scanned field by field (protobuf wire format: varint key, then a varint, 8 or 4
    bytes, or a varint length and that many bytes) to find ``data`` (field 6); protobuf parses the
    rest. Saves two copies of every weight byte against ``WeightChunk.FromString(raw).data``.

    Raises:
        ChunkError: a malformed message (truncated, unknown wire type).
    """
    pos, span = 0, None
    while pos < len(raw):
        key_at = pos
        key, pos = _varint(raw, pos)
        wire_type = key & 7
        if wire_type == 0:
            _, pos = _varint(raw, pos)
        elif wire_type == 2:
            length, pos = _varint(raw, pos)
            if key >> 3 == _DATA_FIELD:
                span = (key_at, pos, pos + length)
            pos += length
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise ChunkError(f"malformed WeightChunk: wire type {wire_type} at byte {key_at}")
    if pos != len(raw):
        raise ChunkError(f"malformed WeightChunk: field runs past the end ({pos} > {len(raw)} bytes)")
    head, data = (raw, b"") if span is None else (raw[:span[0]] + raw[span[2]:], memoryview(raw)[span[1]:span[2]])
    try:
        msg = weights_pb2.WeightChunk.FromString(head)
    except DecodeError as exc:  # e.g. a string field that is not UTF-8
        raise ChunkError(f"malformed WeightChunk: {exc}") from exc
    return TensorChunk(version=msg.version, name=msg.name, dtype=msg.dtype, shape=tuple(msg.shape),
                       offset=msg.offset, data=data, nbytes=msg.nbytes, last_of_tensor=msg.last_of_tensor,
                       checksum=msg.checksum, last_of_version=msg.last_of_version, num_tensors=msg.num_tensors,
                       checksum_kind=msg.checksum_kind, timeline=msg.timeline,
                       chunk_checksum=msg.chunk_checksum if msg.HasField("chunk_checksum") else None,
                       encoding=msg.encoding,
                       base=(msg.base_version, msg.base_timeline) if msg.HasField("base_version") else None)


class _Watchdog:
    """Cancels a streaming call when a started version stalls for more than ``timeout_s`` seconds."""

    def __init__(self, call, timeout_s: float) -> None:
        self._call, self._timeout_s = call, timeout_s
        self._last, self._armed = time.monotonic(), False
        self.fired = False
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def kick(self, in_version: bool) -> None:
        self._last, self._armed = time.monotonic(), in_version

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self._timeout_s / 4)):
            if self._armed and time.monotonic() - self._last > self._timeout_s:
                self.fired = True
                self._call.cancel()
                return
