"""Relay fan-out: a rollout re-serves the weight chunks it receives, while they arrive, to the rollouts below it.

The learner sends each version once per child of its own, not once per rollout: with every rollout relaying to
about ``FANOUT`` others (``relay_parent``: a tree over the fleet's rollout indices), learner egress per version is
one model at any fleet size, and a version reaches the whole fleet in about one transfer time plus one chunk per
tree level (chunks go on as soon as they arrived, not after the version is complete).

A relay forwards each ``WeightChunk`` message exactly as it received it (its bytes, never re-encoded) once its own
``ChunkAssembler`` accepted it: the chunk's XXH3-64 (``WeightChunk.chunk_checksum``) matched on arrival. Every child
checks it again, and every tensor's CRC-32C, so a relay that corrupts a chunk is caught by the next hop
(``WeightSubscriber`` then re-fetches that version from its fallback, the learner). A version the relay loses
mid-stream (its upstream broke, a checksum failed) ends its children's streams with ``UNAVAILABLE``; they retry.
A version the relay received as sparse deltas (``proto.sparse_delta``) goes only to children holding the same base
(in a tree that moves together, all of them); another child is refused (``FAILED_PRECONDITION``) and fetches that
version further up.

``RelayCache`` is fed by the rollout's ``WeightSubscriber`` thread; ``RelayServicer`` serves it on the rollout's
own ``AioServer`` (``Subscribe`` and ``Latest``; ``Announce`` is the NCCL transport's and is not relayed).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import grpc
import structlog

from gyre.proto import weights_pb2
from gyre.proto.timeline import is_new
from gyre.services.common.aio_server import AioServer
from gyre.services.common.security import SecurityConfig
from gyre.services.common.grpc_common import bind_host
from gyre.services.common.weight_stream import WRITE_TIMEOUT_S, WeightStreamServicer, serve_stream

log = structlog.get_logger("weights")

FANOUT = 8
"""Children per relay in ``relay_parent``'s tree."""


def relay_parent(index: int, fanout: int = FANOUT) -> int | None:
    """The rollout index whose relay rollout ``index`` subscribes to, or ``None`` for the learner: rollout 0 takes
    the learner's stream, rollout ``i`` > 0 takes rollout ``(i - 1) // fanout``'s, so each relay has at most
    ``fanout`` children and 256 rollouts are 3 levels below the learner.

    Raises:
        ValueError: a negative ``index`` or ``fanout`` < 1.
    """
    if index < 0 or fanout < 1:
        raise ValueError(f"relay_parent: index {index} must be >= 0 and fanout {fanout} >= 1")
    return None if index == 0 else (index - 1) // fanout


def relay_ancestors(index: int, fanout: int = FANOUT) -> list[int]:
    """Rollout ``index``'s relays up the tree, nearest first (its parent, grandparent, ... rollout 0); ``[]`` for 0.
    A subscriber's fallbacks are these after the parent, then the learner."""
    out, parent = [], relay_parent(index, fanout)
    while parent is not None:
        out.append(parent)
        parent = relay_parent(parent, fanout)
    return out


@dataclass
class RelayedVersion:
    """The chunks of one version as a relay received them, in order (``WeightChunk`` wire bytes)."""

    version: int
    timeline: int
    base: tuple[int, int] | None = None
    """The version it travels relative to (sparse deltas, ``proto.sparse_delta``), or ``None`` (whole)."""
    chunks: list[bytes] = field(default_factory=list)
    complete: bool = False
    """Its last chunk arrived and every tensor checksum matched."""
    abandoned: bool = False
    """Lost mid-stream: the relay's upstream broke or a checksum failed; children reading it are cut off."""


class RelayCache:
    """The newest version a relay holds (complete, or arriving) and the newest complete one. Thread-safe: one
    feeding thread (``add``/``complete``/``abandon``), any number of readers; ``add_listener`` callbacks run after
    every change (from the feeding thread; they must not block)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: RelayedVersion | None = None
        """The version being received, or the newest complete one."""
        self.last_complete: RelayedVersion | None = None
        self._listeners: list[Callable[[], None]] = []
        self.closed = False

    def add_listener(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(callback)

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for callback in listeners:
            callback()

    def add(self, version: int, timeline: int, raw: bytes, base: tuple[int, int] | None = None) -> None:
        """Append one checked chunk of ``version`` (``timeline``; sent relative to ``base``); the first chunk of
        another version starts it."""
        with self._lock:
            cur = self.current
            if cur is None or cur.complete or cur.abandoned or (cur.version, cur.timeline) != (version, timeline):
                if cur is not None and not cur.complete:
                    cur.abandoned = True
                cur = self.current = RelayedVersion(version, timeline, base)
            cur.chunks.append(raw)
        self._notify()

    def complete(self) -> None:
        """The version being received ended and checked out: children may take it whole from now on."""
        with self._lock:
            if self.current is not None and not self.current.abandoned:
                self.current.complete = True
                self.last_complete = self.current
        self._notify()

    def abandon(self) -> None:
        """The version being received is lost (upstream broke, a checksum failed): cut off its readers."""
        with self._lock:
            cur = self.current
            if cur is not None and not cur.complete:
                cur.abandoned = True
                self.current = self.last_complete
        self._notify()

    def close(self) -> None:
        self.closed = True
        self._notify()

    def offer(self, have_version: int, have_timeline: int) -> RelayedVersion | None:
        """The version a child holding ``(have_version, have_timeline)`` should take next: the one arriving or
        newest complete if new to it (``proto.timeline.is_new``), else the newest complete if that is; or ``None``."""
        with self._lock:
            for entry in (self.current, self.last_complete):
                if entry is not None and not entry.abandoned and is_new(entry.version, entry.timeline,
                                                                         have_version, have_timeline):
                    return entry
        return None

    def latest(self) -> tuple[int, int]:
        """``(version, timeline)`` of the newest complete version, ``(-1, 0)`` before the first."""
        with self._lock:
            done = self.last_complete
        return (done.version, done.timeline) if done is not None else (-1, 0)


class RelayServicer(WeightStreamServicer):
    """``WeightService.Subscribe`` and ``Latest`` over a ``RelayCache``: each child gets every chunk of the version
    new to it as soon as the relay has it, then waits for the next version. A version abandoned under a child ends
    its stream with ``UNAVAILABLE`` (it retries, or goes to its fallback)."""

    def __init__(self, cache: RelayCache, write_timeout_s: float = WRITE_TIMEOUT_S) -> None:
        super().__init__(cache, write_timeout_s)
        self.cache = cache

    async def Subscribe(self, request, context):
        have, have_timeline = request.have_version, request.have_timeline
        base = (request.base_version, request.base_timeline) if request.HasField("base_version") else None
        log.info("relay_child_joined", subscriber=request.subscriber, have_version=have)
        notifier = self.notifier()
        while not self.cache.closed:
            entry = self.cache.offer(have, have_timeline)
            if entry is None:
                await notifier.wait(1.0)
                continue
            if entry.base is not None and entry.base != base:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"relay holds version {entry.version} as deltas against {entry.base}; the "
                                    f"subscriber holds {base}: fetch it from further up")
            sent = 0
            while not entry.complete or sent < len(entry.chunks):
                if entry.abandoned:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"relay lost version {entry.version} mid-stream; subscribe again")
                if sent < len(entry.chunks):
                    await self._write(context, entry.chunks[sent])
                    sent += 1
                else:
                    await notifier.wait(1.0)
            have, have_timeline = entry.version, entry.timeline
            base = (entry.version, entry.timeline)

    async def Announce(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a relay serves Subscribe only; NCCL manifests come "
                                                           "from the learner")

    async def Latest(self, request, context):
        version, timeline = self.cache.latest()
        return weights_pb2.LatestResponse(version=version, timeline=timeline)


def serve_relay(cache: RelayCache, host: str | None = None, port: int = 0,
                security: SecurityConfig | None = None) -> tuple[AioServer, int]:
    """Start a relay's ``WeightService`` on ``host:port`` (0: a free port; host defaults to ``security.bind_host``,
    else 127.0.0.1); returns ``(server, bound_port)``."""
    return serve_stream(RelayServicer(cache), bind_host(host, security), port, security)
