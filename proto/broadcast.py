"""The NCCL data path's contract, shared by both ends of the weights path: one ``Broadcast`` collective, its
``torch.distributed`` implementation, and ``receive_verified`` (receive a manifest's tensors, then check them all).

The learner's end is ``services.learner.weight_broadcast`` (``NcclWeightSender``); the rollout's is
``services.rollout.transport.nccl`` (the ``Announce`` stream) and ``rollout.weights`` (vLLM's workers).
"""

from __future__ import annotations

from typing import Protocol

import torch

from gyre.proto.tensor_chunks import DTYPES, ChunkError
from gyre.proto.manifest import TensorMeta, device_checksums, verify_tensor


class TransportUnavailableError(RuntimeError):
    """The configured weight transport cannot run here (e.g. ``type: nccl`` on a machine without CUDA)."""


class Broadcast(Protocol):
    """One collective: send ``tensor`` from rank ``src``; other ranks receive into it in place
    (``torch.distributed.broadcast``, vLLM's ``PyNcclCommunicator.broadcast``)."""

    def __call__(self, tensor: torch.Tensor, src: int) -> None: ...


def receive_verified(broadcast: Broadcast, metas: list[TensorMeta] | tuple[TensorMeta, ...],
                     device: torch.device | str, src: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Receive every tensor of a manifest (in order) from rank ``src``, then verify them all.

    Every tensor is received before any check, so a bad one never leaves the group's collectives out of
    step. Returns ``[(name, tensor)]`` on ``device``, shapes/dtypes as in the manifest.

    Raises:
        ChunkError: unknown dtype in the manifest, or a tensor whose checksum differs (named).
    """
    for m in metas:
        if m.dtype not in DTYPES:
            raise ChunkError(f"tensor {m.name!r}: unknown dtype {m.dtype!r}; expected one of {sorted(DTYPES)}")
    received = []
    for m in metas:
        buf = torch.empty(m.shape, dtype=DTYPES[m.dtype], device=device)
        broadcast(buf, src)
        received.append((m.name, buf))
    sums = device_checksums([t for _, t in received])  # queued behind the broadcasts; one sync
    for m, (_, t), got in zip(metas, received, sums):
        verify_tensor(m, t, got)
    return received


def torch_distributed_broadcast(group=None) -> Broadcast:
    """``Broadcast`` over ``torch.distributed``: the default group (``group=None``, e.g. NCCL initialised
    by ``init_process_group``) or a ``ProcessGroup`` object (e.g. ``ProcessGroupGloo`` on CPU)."""
    import torch.distributed as dist

    def broadcast(tensor: torch.Tensor, src: int) -> None:
        if group is None:
            dist.broadcast(tensor, src=src)
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        group.broadcast([tensor], opts).wait()
    return broadcast


def require_cuda(what: str) -> None:
    """Raise ``TransportUnavailableError`` naming ``what`` when this machine has no CUDA device."""
    if not torch.cuda.is_available():
        raise TransportUnavailableError(
            f"{what}: weight_transport type 'nccl' needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"on this machine (torch {torch.__version__}); use weight_transport type 'grpc' here")
