"""``NcclTransport``: manifests over gRPC ``WeightService.Announce``, bytes in the learner's broadcast group.

The rollout service is its group's leader: it follows ``Announce`` under a fresh incarnation id per stream (an open
stream is what makes it a member of the next group the learner forms, ``services.learner.weight_group``), joins each
new group it is named in on the learner's rendezvous store, receives every version's buckets into two staging
buffers (``proto.buckets``: on its GPU for ``nccl``, in host memory for ``gloo``) and unpacks them into host
tensors, verifies every checksum, and only then hands the version to ``on_version`` (the engine loads it as it
loads a gRPC version: its tensor-parallel workers are fed from there, not from the group).

A version this rollout cannot take from the group is fetched over gRPC ``Subscribe`` with the reason logged
(``weights_over_grpc``): the manifest names no group (nobody was following), this incarnation is not a member (it
joined after the group formed, or the group is full), or the group failed (a member never joined, a broadcast
timed out, a checksum differed). After a failure the rollout re-opens its ``Announce`` stream as a new
incarnation, so the learner's next version re-forms the group with it. Versions only move forward within a
timeline, as with gRPC.
"""

from __future__ import annotations

import datetime
import uuid

import grpc
import structlog
import torch

from gyre.proto import weights_pb2, weights_pb2_grpc
from gyre.proto.broadcast import (FORMED_KEY, TransportUnavailableError, group_broadcast, joined_key, open_group,
                                  require_cuda)
from gyre.proto.buckets import receive_buckets
from gyre.proto.manifest import CHECKSUM_KIND, TensorMeta, VersionManifest
from gyre.proto.tensor_chunks import ChunkAssembler, ChunkError
from gyre.proto.timeline import SHARED, is_new
from gyre.proto.weight_transport import NcclTransportConfig
from gyre.services.common import grpc_common
from gyre.services.common.security import SecurityConfig
from gyre.services.rollout.transport.base import OnVersion, WeightTransport
from gyre.services.rollout.transport.subscriber import (SUBSCRIBE_METHOD, StreamThread, _Watchdog, latest_version,
                                                       parse_chunk)
from gyre.utils.retry import reconnect_forever

log = structlog.get_logger("weights")
__all__ = ["NcclTransport", "to_manifest"]
MAX_BACKOFF_S = 10.0
"""Longest wait (seconds) before re-following a broken ``Announce`` stream (the first is ``backoff_s``)."""


class _Rejoin(Exception):
    """The group failed under this rollout: re-open ``Announce`` as a new incarnation (not counted as an error)."""


class NcclTransport(StreamThread, WeightTransport):
    """Rollout side of the broadcast transport: follows ``WeightService.Announce``, takes each newer version from
    the learner's group (or over gRPC, logged) and hands ``(version, [(name, CPU tensor)], timeline)`` to
    ``on_version``.

    Args:
        config: the run's ``NcclTransportConfig`` (the group's own settings come with each manifest).
        address: ``host:port`` of the learner's WeightService; its rendezvous store is on the same host.
    """

    def __init__(self, config: NcclTransportConfig, address: str, on_version: OnVersion, have_version: int = -1,
                 name: str = "", security: SecurityConfig | None = None, have_timeline: int = SHARED) -> None:
        self.address, self.security, self.name = address, security, name
        self.host = address.rsplit(":", 1)[0]
        self.on_version = on_version
        self.have_version, self.have_timeline = have_version, have_timeline
        self._cursor = (have_version, have_timeline)
        """Newest announced ``(version, timeline)`` this rollout took (from the group or over gRPC) or refused."""
        self.backoff_s, self.chunk_timeout_s = config.backoff_s, config.chunk_timeout_s
        self.incarnation = ""
        """This process's id on the open ``Announce`` stream (new per stream; empty: not a member)."""
        self.can_join = True
        """Whether this process offers to join groups (``False`` once it found it cannot: e.g. ``nccl`` without a
        GPU here; it then follows the announces as a non-member and fetches every version over gRPC)."""
        self._group: tuple[str, object] | None = None
        self._store: tuple[int, object] | None = None
        self._errors = 0
        self._failure: str | None = None
        """Why the group failed under this rollout, logged with the version then fetched over gRPC."""
        self.group_versions = 0
        """Versions received from the broadcast group."""
        self.grpc_versions = 0
        """Versions fetched over gRPC instead (the reasons are logged as ``weights_over_grpc``)."""
        self._init_stream_thread(f"weights-nccl-{name}")

    def latest_version(self, timeout_s: float = 2.0) -> int | None:
        return latest_version(self.address, timeout_s, self.security)

    @property
    def delivered_version(self) -> int:
        return self.have_version

    @property
    def errors(self) -> int:
        return self._errors

    def stop(self) -> None:
        super().stop()
        self._group = None

    def _run(self) -> None:
        reconnect_forever(self._follow, self._stop, (grpc.RpcError, ChunkError, TimeoutError), self.backoff_s,
                          MAX_BACKOFF_S, self._broken)

    def _broken(self, exc: BaseException, retry_in_s: float) -> None:
        self._errors += 1
        log.warning("weight_announce_broken", subscriber=self.name, error=str(exc)[:300], kind=type(exc).__name__,
                    retry_in_s=retry_in_s)

    def _follow(self) -> None:
        while not self._stop.is_set():
            self.incarnation = uuid.uuid4().hex[:12] if self.can_join else ""
            try:
                self._follow_once()
                return
            except _Rejoin:
                continue

    def _follow_once(self) -> None:
        with grpc_common.channel(self.address, self.security) as ch:
            stub = weights_pb2_grpc.WeightServiceStub(ch)
            announces = self._opened(stub.Announce(weights_pb2.SubscribeRequest(
                have_version=self._cursor[0], have_timeline=self._cursor[1], subscriber=self.name,
                incarnation=self.incarnation)))
            for msg in announces:
                manifest = to_manifest(msg)
                if not is_new(manifest.version, manifest.timeline, *self._cursor):
                    continue
                rejoin = self._take(msg.group if msg.HasField("group") else None, manifest, ch)
                self._call = announces
                if rejoin:
                    announces.cancel()  # this incarnation leaves the learner's membership now
                    raise _Rejoin()

    def _take(self, group: weights_pb2.BroadcastGroup | None, manifest: VersionManifest, channel) -> bool:
        """Receive one announced version from its group, else over gRPC, and deliver it. Returns ``True`` (nothing
        delivered) when the group failed under this rollout: the ``Announce`` stream is then re-opened at once as a
        new incarnation (the learner sees the old one leave and re-forms the next group with the new one), and
        the same version, announced again to an incarnation outside its group, is fetched over gRPC."""
        if group is not None and self.incarnation in group.members:
            try:
                tensors = self._receive(group, manifest)
            except Exception as exc:
                self._errors += 1
                self._group = None
                self._failure = f"group {group.group_id} failed: {type(exc).__name__}: {str(exc)[:300]}"
                if isinstance(exc, TransportUnavailableError):  # this process cannot take part: follow as a non-member
                    self.can_join = False
                    self._failure += "; this rollout now follows without joining (every version over gRPC)"
                return True
            self.group_versions += 1
            self._deliver(manifest.version, tensors, manifest.timeline)
            return False
        if self._failure is not None:
            reason, self._failure = self._failure, None
        elif group is None:
            reason = "no broadcast group for this version (no rollout followed the learner when it was announced)"
        else:
            reason = (f"not a member of group {group.group_id} ({len(group.members)} members): joined after it "
                      "formed, or the group is full (weight_transport.max_members)")
        log.info("weights_over_grpc", subscriber=self.name, version=manifest.version, reason=reason)
        while True:  # until this rollout holds the announced version (or a newer one)
            version, tensors, timeline = self._fetch(channel)
            self.grpc_versions += 1
            self._deliver(version, tensors, timeline)
            if not is_new(manifest.version, manifest.timeline, version, timeline):
                return False

    def _receive(self, group: weights_pb2.BroadcastGroup, manifest: VersionManifest):
        stage = "cuda" if group.backend == "nccl" else "cpu"
        return receive_buckets(group_broadcast(self._join(group)), manifest.tensors, group.bucket_bytes, stage)

    def _join(self, group: weights_pb2.BroadcastGroup):
        """This rollout's ``ProcessGroup`` in ``group`` (joined once per group id; the previous one is dropped)."""
        import torch.distributed as dist

        if self._group is not None and self._group[0] == group.group_id:
            return self._group[1]
        self._group = None
        if group.backend == "nccl":  # before announcing the join: a rank that cannot take part never says it will
            require_cuda(f"rollout {self.name!r} in weight group {group.group_id}")
        rank = list(group.members).index(self.incarnation) + 1
        timeout = datetime.timedelta(seconds=group.join_timeout_s)
        if self._store is None or self._store[0] != group.store_port:
            self._store = (group.store_port, dist.TCPStore(self.host, group.store_port, None, False, timeout=timeout))
        store = dist.PrefixStore(group.group_id, self._store[1])
        store.set(joined_key(rank), "1")
        store.wait([FORMED_KEY], 2 * timeout)  # the learner gives up first (join_timeout_s) and says who was missing
        pg = open_group(group.backend, dist.PrefixStore("pg", store), rank, len(group.members) + 1,
                        datetime.timedelta(seconds=group.broadcast_timeout_s))
        self._group = (group.group_id, pg)
        log.info("weights_group_joined", subscriber=self.name, group=group.group_id, rank=rank,
                 members=len(group.members), backend=group.backend)
        return pg

    def _fetch(self, channel) -> tuple[int, list[tuple[str, torch.Tensor]], int]:
        """The newest version new to this rollout over ``Subscribe`` (the first complete, verified one; the stream
        is then closed). Raises ``grpc.RpcError``, ``ChunkError`` or ``TimeoutError`` (no chunk for
        ``chunk_timeout_s``, from the start: the learner publishes every version over gRPC)."""
        subscribe = channel.unary_stream(SUBSCRIBE_METHOD,
                                         request_serializer=weights_pb2.SubscribeRequest.SerializeToString,
                                         response_deserializer=None)
        call = self._opened(subscribe(weights_pb2.SubscribeRequest(
            have_version=self.have_version, have_timeline=self.have_timeline, subscriber=self.name)))
        watchdog = _Watchdog(call, self.chunk_timeout_s)
        watchdog.kick(in_version=True)
        assembler = ChunkAssembler()
        try:
            for raw in call:
                watchdog.kick(in_version=True)
                msg = parse_chunk(raw)
                done = assembler.feed(msg)
                if done is not None:
                    return done[0], done[1], msg.timeline
        finally:
            watchdog.stop()
            call.cancel()
        if watchdog.fired:
            raise TimeoutError(f"no weight chunk for {self.chunk_timeout_s}s over gRPC; fetch abandoned")
        raise grpc.RpcError("the learner's Subscribe stream ended before a version")

    def _deliver(self, version: int, tensors, timeline: int) -> None:
        """Hand one version to ``on_version``; a refusal is counted and logged and the cursor moves past it either
        way (the next version is what the rollout waits for)."""
        try:
            if is_new(version, timeline, self.have_version, self.have_timeline):
                self.on_version(version, tensors, timeline)
                self.have_version, self.have_timeline = version, timeline
        except Exception as exc:
            self._errors += 1
            log.warning("weight_version_refused", subscriber=self.name, version=version,
                        kept_version=self.have_version, error=repr(exc)[:300])
        finally:
            if is_new(version, timeline, *self._cursor):
                self._cursor = (version, timeline)


def to_manifest(msg: weights_pb2.VersionManifest) -> VersionManifest:
    """Proto → ``VersionManifest``. Raises ``ChunkError`` for a checksum algorithm this build lacks."""
    if msg.checksum_kind != CHECKSUM_KIND:
        raise ChunkError(f"version {msg.version}: checksum kind {msg.checksum_kind!r}, expected {CHECKSUM_KIND!r}")
    return VersionManifest(msg.version, tuple(
        TensorMeta(t.name, t.dtype, tuple(t.shape), t.nbytes, t.checksum) for t in msg.tensors), msg.checksum_kind,
        msg.timeline)
