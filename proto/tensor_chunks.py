"""Named tensors ↔ checksummed byte chunks: the payload of ``WeightService.Subscribe``.

Pure logic (no grpc): the learner's publisher cuts a policy version into ``TensorChunk``s; a
subscriber feeds them to ``ChunkAssembler``, which verifies every tensor's CRC32 and shape and only
then returns the whole version. Raw little-endian bytes with a named dtype — never pickle.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterator

import torch

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


class ChunkError(ValueError):
    """A chunk stream that is out of order, truncated, mistyped or fails its checksum."""


@dataclass(frozen=True)
class TensorChunk:
    """One piece of one tensor of one policy version (mirrors ``weights.proto`` ``WeightChunk``)."""

    version: int
    name: str
    dtype: str
    """Key of ``DTYPES``."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset of ``data`` within the tensor's bytes."""
    data: bytes
    nbytes: int
    """Byte size of the whole tensor."""
    last_of_tensor: bool = False
    crc32: int = 0
    """zlib CRC32 of the whole tensor's bytes; set on its last chunk."""
    last_of_version: bool = False
    num_tensors: int = 0
    """Number of tensors in the version; set on the version's last chunk."""


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor flattened to bytes once per version, shared by every subscriber's stream."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes
    crc32: int


def encode_tensors(named: list[tuple[str, torch.Tensor]]) -> list[EncodedTensor]:
    """Flatten tensors to raw bytes + CRC32. Raises ``ChunkError`` for an unsupported dtype."""
    by_dtype = {v: k for k, v in DTYPES.items()}
    out = []
    for name, t in named:
        if t.dtype not in by_dtype:
            raise ChunkError(f"tensor {name!r} has dtype {t.dtype}; supported: {sorted(DTYPES)}")
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out.append(EncodedTensor(name, by_dtype[t.dtype], tuple(t.shape), raw, zlib.crc32(raw)))
    return out


def iter_chunks(version: int, tensors: list[EncodedTensor], chunk_bytes: int) -> Iterator[TensorChunk]:
    """Cut a version into chunks of at most ``chunk_bytes`` bytes, tensors in order."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes ({chunk_bytes}) must be >= 1")
    for i, t in enumerate(tensors):
        n = len(t.data)
        offsets = range(0, max(n, 1), chunk_bytes)
        for offset in offsets:
            last = offset + chunk_bytes >= n
            yield TensorChunk(
                version=version, name=t.name, dtype=t.dtype, shape=t.shape, offset=offset,
                data=t.data[offset:offset + chunk_bytes], nbytes=n, last_of_tensor=last,
                crc32=t.crc32 if last else 0,
                last_of_version=last and i == len(tensors) - 1,
                num_tensors=len(tensors) if last and i == len(tensors) - 1 else 0,
            )


class ChunkAssembler:
    """Stages the chunks of one version; returns the named tensors once all are verified."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.version: int | None = None
        self._buf = bytearray()
        self._current: TensorChunk | None = None
        self._done: list[tuple[str, torch.Tensor]] = []

    def feed(self, chunk: TensorChunk) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """Add a chunk; returns ``(version, [(name, tensor)])`` after the version's last chunk.

        Raises:
            ChunkError: version change mid-stream, offset gap, unknown dtype, size/shape mismatch,
                CRC32 mismatch, or a tensor count that disagrees. The partial version is discarded.
        """
        try:
            return self._feed(chunk)
        except ChunkError:
            self._reset()
            raise

    def _feed(self, c: TensorChunk):
        if self.version is None:
            self.version = c.version
        if c.version != self.version:
            raise ChunkError(f"chunk of version {c.version} arrived while staging version {self.version}")
        if self._current is None or self._current.name != c.name:
            if self._buf:
                raise ChunkError(f"tensor {self._current.name!r} ended without its last chunk")
            self._current = c
        if c.dtype not in DTYPES:
            raise ChunkError(f"tensor {c.name!r}: unknown dtype {c.dtype!r}; expected one of {sorted(DTYPES)}")
        if c.offset != len(self._buf):
            raise ChunkError(f"tensor {c.name!r}: chunk at offset {c.offset}, expected {len(self._buf)}")
        self._buf += c.data
        if not c.last_of_tensor:
            return None
        self._done.append((c.name, self._finish_tensor(c)))
        self._buf = bytearray()
        if not c.last_of_version:
            return None
        if c.num_tensors != len(self._done):
            raise ChunkError(f"version {c.version}: {len(self._done)} tensors received, {c.num_tensors} sent")
        version, tensors = self.version, self._done
        self._reset()
        return version, tensors

    def _finish_tensor(self, c: TensorChunk) -> torch.Tensor:
        if len(self._buf) != c.nbytes:
            raise ChunkError(f"tensor {c.name!r}: {len(self._buf)} bytes received, {c.nbytes} expected")
        crc = zlib.crc32(self._buf)
        if crc != c.crc32:
            raise ChunkError(f"tensor {c.name!r}: checksum {crc:#010x} != sent {c.crc32:#010x}")
        dtype = DTYPES[c.dtype]
        numel = 1
        for d in c.shape:
            numel *= d
        if numel * dtype.itemsize != c.nbytes:
            raise ChunkError(f"tensor {c.name!r}: shape {list(c.shape)} × {c.dtype} != {c.nbytes} bytes")
        # No copy: the caller replaces self._buf with a fresh bytearray, so the tensor owns this one.
        return torch.frombuffer(self._buf, dtype=torch.uint8).view(dtype).reshape(c.shape)
