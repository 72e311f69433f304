"""One version's bytes as a few large broadcasts: the bucket plan both ends compute from the manifest, and the
double-buffered send and receive over an asynchronous collective (``proto.broadcast.StartBroadcast``).

A version's tensors, in manifest order, are read as one byte string and cut into buckets of ``bucket_bytes`` (the
last shorter; a tensor may straddle buckets). Each end holds two staging buffers of one bucket on the device the
collective runs on (``nccl``: the GPU; ``gloo``: host memory): while bucket ``k`` is in flight, bucket ``k + 1`` is
packed (sender) or bucket ``k - 1`` unpacked (receiver), so staging memory is ``2 × bucket_bytes`` whatever the
model's size, and a version of many small tensors costs a few collectives, not one per tensor (verl's bucketed
``update_weights``, NeMo-RL's refit buckets work the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from gyre.proto.broadcast import StartBroadcast
from gyre.proto.manifest import TensorMeta, device_checksums, verify_tensor
from gyre.proto.tensor_chunks import DTYPES, ChunkError

__all__ = ["Segment", "bucket_plan", "receive_buckets", "send_buckets"]


@dataclass(frozen=True)
class Segment:
    """Bytes ``[tensor_offset, tensor_offset + nbytes)`` of tensor ``tensor`` (manifest index) sit at
    ``[bucket_offset, bucket_offset + nbytes)`` of their bucket."""

    tensor: int
    tensor_offset: int
    bucket_offset: int
    nbytes: int


def bucket_plan(nbytes: Sequence[int], bucket_bytes: int) -> list[list[Segment]]:
    """Cut tensors of ``nbytes`` bytes each (in order) into buckets of ``bucket_bytes`` bytes (the last shorter).

    Returns one list of ``Segment`` per bucket; empty tensors take no segment. Raises ``ValueError`` for
    ``bucket_bytes < 1`` or a negative size.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes ({bucket_bytes}) must be >= 1")
    buckets: list[list[Segment]] = []
    current: list[Segment] = []
    fill = 0
    for i, n in enumerate(nbytes):
        if n < 0:
            raise ValueError(f"tensor {i}: negative size {n}")
        offset = 0
        while offset < n:
            take = min(n - offset, bucket_bytes - fill)
            current.append(Segment(i, offset, fill, take))
            offset, fill = offset + take, fill + take
            if fill == bucket_bytes:
                buckets.append(current)
                current, fill = [], 0
    if current:
        buckets.append(current)
    return buckets


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of contiguous ``t``'s bytes."""
    return t.reshape(-1).view(torch.uint8)


def _size(segments: list[Segment]) -> int:
    return segments[-1].bucket_offset + segments[-1].nbytes


def send_buckets(start: StartBroadcast, tensors: Sequence[torch.Tensor], bucket_bytes: int, src: int = 0) -> int:
    """Broadcast ``tensors`` (contiguous, any dtype, all on the collective's device) from rank ``src`` in buckets;
    returns the number of buckets. Blocks until the last one was sent.

    Raises:
        RuntimeError: the collective failed or timed out (the group is then unusable).
    """
    views = [_bytes(t) for t in tensors]
    plan = bucket_plan([v.numel() for v in views], bucket_bytes)
    if not plan:
        return 0
    device = views[0].device
    staging = [torch.empty(min(bucket_bytes, _size(plan[0])), dtype=torch.uint8, device=device)
               for _ in range(min(2, len(plan)))]
    in_flight: list = [None] * len(staging)
    for k, segments in enumerate(plan):
        slot = k % len(staging)
        if in_flight[slot] is not None:
            in_flight[slot].wait()  # this buffer's previous bucket is out: refill it
        buf = staging[slot][:_size(segments)]
        for s in segments:
            buf[s.bucket_offset:s.bucket_offset + s.nbytes].copy_(
                views[s.tensor][s.tensor_offset:s.tensor_offset + s.nbytes])
        in_flight[slot] = start(buf, src)
    for work in in_flight:
        if work is not None:
            work.wait()
    return len(plan)


def receive_buckets(start: StartBroadcast, metas: Sequence[TensorMeta], bucket_bytes: int,
                    stage_device: torch.device | str, out_device: torch.device | str = "cpu",
                    src: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Receive a manifest's tensors from rank ``src`` (``send_buckets``' other end), then verify them all.

    Every bucket is received before any check, so a bad tensor never leaves the group's collectives out of step.
    Buckets land in two staging buffers on ``stage_device`` and are unpacked into fresh tensors on ``out_device``.

    Returns:
        ``[(name, tensor)]`` on ``out_device``, shapes and dtypes as in the manifest.

    Raises:
        ChunkError: a dtype this build lacks (before anything is received), or a tensor whose checksum differs
            (named; after everything was received).
        RuntimeError: the collective failed or timed out.
    """
    for m in metas:
        if m.dtype not in DTYPES:
            raise ChunkError(f"tensor {m.name!r}: unknown dtype {m.dtype!r}; expected one of {sorted(DTYPES)}")
    out = [torch.empty(m.shape, dtype=DTYPES[m.dtype], device=out_device) for m in metas]
    views = [_bytes(t) for t in out]
    plan = bucket_plan([v.numel() for v in views], bucket_bytes)
    if plan:
        staging = [torch.empty(min(bucket_bytes, _size(plan[0])), dtype=torch.uint8, device=stage_device)
                   for _ in range(min(2, len(plan)))]
        in_flight = [(k, start(staging[k][:_size(plan[k])], src)) for k in range(len(staging))]
        while in_flight:
            k, work = in_flight.pop(0)
            work.wait()
            buf = staging[k % len(staging)]
            for s in plan[k]:
                views[s.tensor][s.tensor_offset:s.tensor_offset + s.nbytes].copy_(
                    buf[s.bucket_offset:s.bucket_offset + s.nbytes])
            following = k + len(staging)
            if following < len(plan):
                in_flight.append((following, start(buf[:_size(plan[following])], src)))
    sums = device_checksums(out)
    for m, t, got in zip(metas, out, sums):
        verify_tensor(m, t, got)
    return [(m.name, t) for m, t in zip(metas, out)]
