"""The broadcast weight transport's contract, shared by both ends: a process group of its own
(``open_group``: NCCL or gloo), its asynchronous broadcast (``StartBroadcast``), and the rendezvous keys a group is
formed with. How a version's bytes are cut into buckets is ``proto.buckets``.

The learner's end is ``services.learner.weight_group`` (``WeightGroup``); the rollout's is
``services.rollout.transport.nccl`` (``NcclTransport``).
"""

from __future__ import annotations

import datetime
import os
from typing import Protocol

import torch



class TransportUnavailableError(RuntimeError):
    """The configured weight transport cannot run here (e.g. ``type: nccl`` on a machine without CUDA)."""


class Work(Protocol):
    """A collective in flight (``torch.distributed.Work``): ``wait()`` blocks until it is done, or raises."""

    def wait(self) -> bool: ...


class StartBroadcast(Protocol):
    """Start one broadcast of ``tensor`` from rank ``src`` (receivers: into it in place) and return its ``Work``
    (``group_broadcast``)."""

    def __call__(self, tensor: torch.Tensor, src: int) -> Work: ...


FORMED_KEY = "formed"
"""Rendezvous-store key (under a group's prefix) the learner sets once every member is joining; members wait for it
before they construct their side of the group (``services.learner.weight_group``)."""


def joined_key(rank: int) -> str:
    """Rendezvous-store key (under a group's prefix) a member sets when it starts joining as ``rank``."""
    return f"joined/{rank}"


NCCL_GROUP_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
"""torch's NCCL settings while a weight group is constructed (``open_group``)."""


def open_group(backend: str, store, rank: int, size: int, timeout: datetime.timedelta):
    """A ``torch.distributed`` process group of its own (not the default group: the learner's DeepSpeed ranks
    keep theirs) over ``store``: ``ProcessGroupGloo`` or ``ProcessGroupNCCL``. Blocks until all ``size`` ranks
    constructed theirs (at most ``timeout``, which also bounds every collective).

    Raises:
        ValueError: ``backend`` is neither ``gloo`` nor ``nccl``.
        TransportUnavailableError: ``nccl`` without a CUDA device.
        RuntimeError: (``torch.distributed``'s ``DistStoreError`` and kin) a rank did not join in time.
    """
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend != "nccl":
        raise ValueError(f"broadcast group backend {backend!r}: expected 'nccl' or 'gloo'")
    require_cuda("the weight broadcast group")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    # Read by the constructor, per group: a failed or timed-out broadcast raises in ``Work.wait`` (the host waits),
    # and NCCL's watchdog does not tear the process down (its default): the learner and the rollouts outlive a
    # broken weight group, and the version goes over gRPC. The learner's own DeepSpeed group keeps its settings.
    saved = {k: os.environ.get(k) for k in NCCL_GROUP_ENV}
    os.environ.update(NCCL_GROUP_ENV)
    try:
        return dist.ProcessGroupNCCL(store, rank, size, options)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def group_broadcast(group) -> StartBroadcast:
    """``StartBroadcast`` over a ``ProcessGroup`` object (``open_group``): asynchronous, returns the ``Work``."""
    import torch.distributed as dist

    def start(tensor: torch.Tensor, src: int) -> Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return group.broadcast([tensor], opts)
    return start


def require_cuda(what: str) -> None:
    """Raise ``TransportUnavailableError`` naming ``what`` when this machine has no CUDA device."""
    if not torch.cuda.is_available():
        raise TransportUnavailableError(
            f"{what}: weight_transport type 'nccl' needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"on this machine (torch {torch.__version__}); use weight_transport type 'grpc' here")
