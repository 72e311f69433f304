"""The learner's end of the broadcast weight transport (``weight_transport: nccl``): it forms a group of itself
(rank 0) and one leader per rollout, announces each version with that group, and broadcasts the version's bytes in
buckets (``proto.buckets``). The rollout's end is ``services.rollout.transport.nccl``.

Membership is what the learner sees: the rollouts whose ``WeightService.Announce`` streams are open
(``GroupMembers``), each under a fresh incarnation id per stream. At each version the learner compares them with
the group's members and re-forms the group when they differ (a rollout joined, left, restarted, or the learner
itself restarted): a new ``group_id``, a rendezvous on the learner's own ``TCPStore``, every member given
``join_timeout_s`` to join. A version whose group failed (a member never joined, a broadcast failed or timed out)
is not lost: it is published over gRPC as every version is (``learner.background_publish``), and the members fetch
it there; the members that never joined are left out until they reconnect. Rollouts past ``max_members`` are never
members (``weights_group_full``): they fetch over gRPC.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid

import structlog
import torch

from gyre.learner.publisher import WeightPublisher
from gyre.proto import weights_pb2
from gyre.proto.broadcast import FORMED_KEY, group_broadcast, joined_key, open_group
from gyre.proto.buckets import send_buckets
from gyre.proto.manifest import tensor_metas
from gyre.proto.weight_transport import NcclTransportConfig

log = structlog.get_logger("weights")
__all__ = ["GroupJoinError", "GroupMembers", "WeightGroup", "resolve_backend"]


JOIN_POLL_S = 0.05
"""How often (seconds) the learner checks, while a group forms, who joined and who left."""


class GroupJoinError(RuntimeError):
    """Members did not join a newly formed group within ``join_timeout_s`` (named in the message)."""


def resolve_backend(backend: str) -> str:
    """``auto`` → ``nccl`` on a machine with a CUDA device, else ``gloo``; other values as they are."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


class GroupMembers:
    """Incarnations of the open ``Announce`` streams, in the order they opened (thread-safe). The weight server
    adds one per stream and removes it when the stream ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, str] = {}

    def add(self, incarnation: str, name: str) -> None:
        with self._lock:
            self._open[incarnation] = name

    def remove(self, incarnation: str) -> None:
        with self._lock:
            self._open.pop(incarnation, None)

    def snapshot(self) -> dict[str, str]:
        """``{incarnation: rollout name}`` of the open streams, oldest first."""
        with self._lock:
            return dict(self._open)


class WeightGroup:
    """Announces and broadcasts each version to the current group (re-formed when membership changed).

    Args:
        config: the run's ``NcclTransportConfig``.
        publisher: where versions are announced (``WeightService.Announce`` serves them).
        members: the open ``Announce`` streams (``GroupMembers``, shared with the weight server).
        host: address the rendezvous store listens on (the weight server's bind host).

    Raises:
        TransportUnavailableError: ``backend`` resolves to ``nccl`` on a machine without CUDA.
    """

    def __init__(self, config: NcclTransportConfig, publisher: WeightPublisher, members: GroupMembers,
                 host: str = "127.0.0.1") -> None:
        import torch.distributed as dist

        from gyre.proto.broadcast import require_cuda

        self.config, self.publisher, self.members = config, publisher, members
        self.backend = resolve_backend(config.backend)
        if self.backend == "nccl":
            require_cuda("the learner's weight broadcast group")
        self.store = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=config.join_timeout_s),
                                   wait_for_workers=False)
        self.learner_id = uuid.uuid4().hex[:8]
        self.generation = 0
        self.group_members: tuple[str, ...] = ()
        """Incarnations in the current group (rank ``i + 1`` each), empty before the first."""
        self._group = None
        self._left_out: set[str] = set()
        """Incarnations that never joined a group they were named in: not named again until they reconnect."""
        self._full_logged: tuple[int, int] | None = None
        self.sent = 0
        """Versions delivered over the group."""
        self.failed = 0
        """Versions whose group failed (they went over gRPC)."""
        self.reforms = 0
        """Groups formed (the first included)."""
        self.last_send_s = 0.0
        """Seconds the newest version's announce + (re-forming) + broadcast took."""

    @property
    def store_port(self) -> int:
        return self.store.port

    def _next_members(self) -> tuple[str, ...]:
        open_ = self.members.snapshot()
        self._left_out &= set(open_)
        eligible = [inc for inc in open_ if inc not in self._left_out]
        cap = self.config.max_members
        if len(eligible) > cap and self._full_logged != (len(eligible), cap):
            self._full_logged = (len(eligible), cap)
            log.warning("weights_group_full", rollouts=len(eligible), max_members=cap,
                        over_grpc=[open_[i] for i in eligible[cap:]],
                        reason=f"{len(eligible)} rollouts follow the learner, the group takes {cap} "
                               "(weight_transport.max_members): the rest fetch every version over gRPC")
        return tuple(eligible[:cap])

    def send(self, version: int, timeline: int, captured: list[tuple[str, torch.Tensor]],
             ready: "torch.cuda.Event | None" = None) -> bool:
        """Announce ``version`` of ``timeline`` with the group, re-forming it first if membership changed, then
        broadcast its bytes. ``ready``: a CUDA event recorded after ``captured`` was written (waited for on this
        thread's stream). Returns whether the group delivered it; on ``False`` (logged ``weights_group_failed``
        with the reason) its members fetch it over gRPC.

        Raises:
            ValueError: ``version`` is not newer than the announced one (nothing announced).
        """
        t0 = time.perf_counter()
        members = self._next_members()
        reform = self._group is None or members != self.group_members
        if reform and members:
            self.generation += 1
        if ready is not None:  # the capture's copies were queued on the training stream
            torch.cuda.current_stream(next(t.device for _, t in captured if t.is_cuda)).wait_event(ready)
        metas = tensor_metas(captured)  # where the weights are; every version is announced, whatever follows
        group_id = f"{self.learner_id}-{self.generation}"
        info = weights_pb2.BroadcastGroup(
            group_id=group_id, members=list(members), store_port=self.store_port, backend=self.backend,
            bucket_bytes=self.config.bucket_bytes, join_timeout_s=self.config.join_timeout_s,
            broadcast_timeout_s=self.config.broadcast_timeout_s) if members else None
        self.publisher.announce(version, metas, timeline, group=info)
        if not members:
            self._group, self.group_members = None, ()
            return False
        try:
            tensors = self._on_backend_device([t for _, t in captured])
            if reform:
                self._form(group_id, members)
            buckets = send_buckets(group_broadcast(self._group), tensors, self.config.bucket_bytes)
        except Exception as exc:
            self.failed += 1
            self._group, self.group_members = None, ()
            log.warning("weights_group_failed", version=version, group=group_id, members=len(members),
                        error=f"{type(exc).__name__}: {str(exc)[:300]}",
                        fallback="the members fetch this version over gRPC; the next version re-forms the group")
            return False
        self.sent += 1
        self.last_send_s = time.perf_counter() - t0
        log.info("weights_group_sent", version=version, group=group_id, members=len(members), buckets=buckets,
                 reformed=reform, seconds=round(self.last_send_s, 3))
        return True

    def _on_backend_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors where the backend moves them from: host memory for gloo, the GPU for nccl."""
        if self.backend == "gloo":
            return [t.detach().to("cpu").contiguous() for t in tensors]
        return [t.detach().contiguous() if t.is_cuda else t.detach().to("cuda").contiguous() for t in tensors]

    def _form(self, group_id: str, members: tuple[str, ...]) -> None:
        """Rendezvous ``members`` as ranks 1.. on the store under ``group_id``; raises ``GroupJoinError`` naming
        who did not join within ``join_timeout_s`` (they are left out of the next groups until they reconnect)."""
        import torch.distributed as dist

        self._group, self.group_members = None, ()
        store = dist.PrefixStore(group_id, self.store)
        deadline = time.monotonic() + self.config.join_timeout_s
        while True:  # every member said it is joining, or one left (its stream closed: no wait), or time is up
            missing = [m for r, m in enumerate(members, 1) if not store.check([joined_key(r)])]
            names = self.members.snapshot()
            if not missing:
                break
            left = [m for m in members if m not in names]
            if left:
                raise GroupJoinError(f"{len(left)} of {len(members)} member(s) left while group {group_id} formed")
            if time.monotonic() > deadline:
                self._left_out |= set(missing)
                raise GroupJoinError(f"{len(missing)} of {len(members)} member(s) did not join group {group_id} "
                                     f"within {self.config.join_timeout_s}s: {[names.get(m, m) for m in missing]} "
                                     "(left out until they reconnect)")
            time.sleep(JOIN_POLL_S)
        store.set(FORMED_KEY, "1")
        self._group = open_group(self.backend, dist.PrefixStore("pg", store), 0, len(members) + 1,
                                 datetime.timedelta(seconds=self.config.broadcast_timeout_s))
        self.group_members = members
        self.reforms += 1
        log.info("weights_group_formed", group=group_id, members=[names.get(m, m) for m in members],
                 backend=self.backend, reform=self.reforms)
