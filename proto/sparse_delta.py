"""Sparse delta versions: a tensor as the elements that changed since a base version the subscriber holds.

With RL learning rates most bf16 weights are bit-identical from one policy version to the next (NeMo-RL reports ~3%
of elements changing, the idea behind its sparse-delta refit, verl's ``delta_sharded`` and slime's delta sync; on
gyre's default recipe 6.6% of bf16 elements differ between versions ten steps apart). A delta tensor is

    u32 count | u32 zstd length | zstd(u32 gaps between changed element positions) | count new element values

(little-endian; elements compared as raw ``itemsize``-byte words, so any dtype works bit-exactly). It is used only
when it is smaller than the tensor; the receiver rebuilds the tensor from its base and checks the result against the
full tensor's CRC-32C, so a delta against the wrong base is refused, never applied.
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

ENCODING = "sparse-v1"
"""Name of this format on the wire (``WeightChunk.encoding``)."""

_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_HEAD = struct.Struct("<II")


class DeltaError(ValueError):
    """A delta that does not decode against its base (truncated, out of range, wrong sizes)."""


def _words(data, itemsize: int) -> np.ndarray:
    if itemsize not in _WORDS:
        raise DeltaError(f"element size {itemsize} bytes; expected one of {sorted(_WORDS)}")
    if len(data) % itemsize:
        raise DeltaError(f"{len(data)} bytes is not a whole number of {itemsize}-byte elements")
    return np.frombuffer(data, dtype=_WORDS[itemsize])


def encode_delta(base, new, itemsize: int, level: int = 1) -> bytes | None:
    """The delta turning ``base`` into ``new`` (equal-sized buffers of ``itemsize``-byte elements), or ``None`` when
    it would not be smaller than ``new`` (send the tensor whole).

    Raises:
        DeltaError: sizes differ or are not whole elements.
    """
    if len(base) != len(new):
        raise DeltaError(f"base has {len(base)} bytes, new version {len(new)}")
    a, b = _words(base, itemsize), _words(new, itemsize)
    changed = np.flatnonzero(a != b)
    if _HEAD.size + changed.size * (itemsize + 1) >= len(new):  # hopeless before compressing the positions
        return None
    gaps = np.diff(changed, prepend=0).astype(np.uint32)  # positions < 2**32 elements per tensor
    packed = zstandard.ZstdCompressor(level=level).compress(gaps.tobytes())
    out = b"".join((_HEAD.pack(changed.size, len(packed)), packed, b[changed].tobytes()))
    return out if len(out) < len(new) else None


def density(base, new, itemsize: int) -> float:
    """Fraction of ``itemsize``-byte elements that differ between two equal-sized buffers."""
    a, b = _words(base, itemsize), _words(new, itemsize)
    return float(np.count_nonzero(a != b)) / max(a.size, 1)


def apply_delta(base, delta, itemsize: int) -> bytes:
    """``base`` with ``delta``'s changes applied: the new tensor's bytes (a private copy).

    Raises:
        DeltaError: the delta is truncated or names positions past the base.
    """
    if len(delta) < _HEAD.size:
        raise DeltaError(f"delta of {len(delta)} bytes is shorter than its {_HEAD.size}-byte header")
    count, packed_len = _HEAD.unpack_from(delta)
    values_at = _HEAD.size + packed_len
    if len(delta) != values_at + count * itemsize:
        raise DeltaError(f"delta of {len(delta)} bytes; its header says {values_at + count * itemsize}")
    try:
        gaps = np.frombuffer(zstandard.ZstdDecompressor().decompress(bytes(delta[_HEAD.size:values_at]),
                                                                     max_output_size=4 * count), dtype=np.uint32)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"delta positions do not decompress: {exc}") from exc
    if gaps.size != count:
        raise DeltaError(f"delta lists {gaps.size} positions; its header says {count}")
    out = _words(base, itemsize).copy()
    positions = np.cumsum(gaps, dtype=np.int64)
    if count and positions[-1] >= out.size:
        raise DeltaError(f"delta changes element {int(positions[-1])} of a {out.size}-element tensor")
    out[positions] = np.frombuffer(delta, dtype=out.dtype, count=count, offset=values_at)
    return out.tobytes()


def changed_count(delta) -> int:
    """Number of elements a delta changes (its header's count)."""
    return _HEAD.unpack_from(delta)[0]
