"""A version's manifest: its tensors' names, dtypes, shapes and device-computed checksums without their bytes.

The NCCL transport's control channel (``WeightService.Announce``): the learner announces a manifest, the bytes travel
in a broadcast (``proto.broadcast``), and every receiver checks each tensor against it (``verify_tensor``). Checksums
are computed where the tensors live (GPU or CPU), one synchronisation per device (``device_checksums``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyre.proto.tensor_chunks import DTYPES, ChunkError

CHECKSUM_KIND = "wsum64-v1"
"""Name of ``device_checksum``'s algorithm, sent with every manifest so both sides agree on it."""

_PERIOD = 65521
"""Largest prime below 2**16: word ``i`` is weighted by ``1 + (i mod _PERIOD)`` (Adler-32's modulus)."""
_STEP_WORDS = _PERIOD * 64
"""Words per step (~4.2 M): a multiple of the weight period, so one cached weight vector serves every step."""
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype, shape and checksum of one tensor of a version (mirrors ``weights.proto`` ``TensorMeta``)."""

    name: str
    dtype: str
    """Key of ``DTYPES``."""
    shape: tuple[int, ...]
    nbytes: int
    checksum: int
    """``device_checksum`` of the tensor (unsigned 64-bit)."""


def device_checksum(t: torch.Tensor) -> int:
    """Position-weighted 64-bit sum of a tensor's bytes, computed where the tensor lives (GPU or CPU).

    The bytes are read as int32 words (uint8 when the size is not a multiple of 4), widened to int64,
    multiplied by ``1 + (i mod 65521)`` (so swapped or shifted words change it, as in Fletcher/Adler
    checksums) and summed with wrap-around, which is exact and order-independent on every device.
    Returns an unsigned int in ``[0, 2**64)``. Peak extra memory: 16 bytes per word of one ~4.2 M-word step,
    plus a cached 17 MB weight vector per device. For many tensors use ``device_checksums`` (one sync).
    """
    return device_checksums([t])[0]


def device_checksums(tensors: list[torch.Tensor]) -> list[int]:
    """``device_checksum`` of each tensor, queued on the tensors' devices and read back with one
    synchronisation per device (not one per tensor: a 300-tensor version on a GPU otherwise stalls 300 times)."""
    sums = [_checksum_async(t) for t in tensors]
    out: list[int | None] = [None] * len(sums)
    for device in {s.device for s in sums}:
        idx = [i for i, s in enumerate(sums) if s.device == device]
        for i, v in zip(idx, torch.stack([sums[i] for i in idx]).tolist()):
            out[i] = v & 0xFFFF_FFFF_FFFF_FFFF
    return out  # type: ignore[return-value]


def _position_weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:  # a race builds it twice: harmless
        w = (torch.arange(_STEP_WORDS, device=device, dtype=torch.int64) % _PERIOD + 1).to(torch.int32)
        _WEIGHTS[device] = w
    return w


def _checksum_async(t: torch.Tensor) -> torch.Tensor:
    """0-d int64 on ``t.device``: the signed form of ``device_checksum(t)``, not yet read back."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat
    weights = _position_weights(t.device)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _STEP_WORDS):  # every step starts at a multiple of the period
        part = words[start:start + _STEP_WORDS]
        total += (part.to(torch.int64) * weights[:part.numel()]).sum()
    return total


def tensor_metas(named: list[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    """Manifest of a version: one ``TensorMeta`` per tensor, checksums computed on the tensors' device.

    Raises ``ChunkError`` for an unsupported dtype.
    """
    by_dtype = {v: k for k, v in DTYPES.items()}
    for name, t in named:
        if t.dtype not in by_dtype:
            raise ChunkError(f"tensor {name!r} has dtype {t.dtype}; supported: {sorted(DTYPES)}")
    sums = device_checksums([t for _, t in named])
    return [TensorMeta(name, by_dtype[t.dtype], tuple(t.shape), t.numel() * t.element_size(), checksum)
            for (name, t), checksum in zip(named, sums)]


def verify_tensor(meta: TensorMeta, t: torch.Tensor, got: int) -> None:
    """Check a received tensor against its manifest entry; ``got`` is its ``device_checksum`` (computed by
    the caller, batched over a version with ``device_checksums``).

    Raises:
        ChunkError: dtype, shape or checksum differs (the message names the tensor and both values).
    """
    if t.dtype != DTYPES.get(meta.dtype) or tuple(t.shape) != tuple(meta.shape):
        raise ChunkError(f"tensor {meta.name!r}: received {t.dtype} {list(t.shape)}, "
                         f"manifest says {meta.dtype} {list(meta.shape)}")
    if got != meta.checksum:
        raise ChunkError(f"tensor {meta.name!r}: checksum {got:#018x} != sent {meta.checksum:#018x}")


@dataclass(frozen=True)
class VersionManifest:
    """A version announced without its bytes: the tensors a receiver must take from the broadcast."""

    version: int
    tensors: tuple[TensorMeta, ...]
    checksum_kind: str = CHECKSUM_KIND
    timeline: int = 0
    """Timeline of ``version`` (``proto.timeline``)."""
