"""Named tensors ↔ checksummed byte chunks: the payload of ``WeightService.Subscribe``.

Pure logic (no grpc): the learner's publisher cuts a policy version into ``TensorChunk``s; a
subscriber feeds them to ``ChunkAssembler``, which verifies every tensor's checksum (CRC-32C, named on
every chunk), dtype and shape and only then returns the whole version. Raw little-endian bytes with a
named dtype — never pickle.
"""

from __future__ import annotations

import dataclasses
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import google_crc32c
import torch
import xxhash

from gyre.proto import sparse_delta

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


MAX_TENSOR_BYTES = 64 << 30
"""Largest tensor a subscriber stages (bytes): a chunk claiming more is refused before allocating it."""

CHUNK_CHECKSUM_KIND = "crc32c"
"""Checksum algorithm of the chunk stream, written on every chunk: CRC-32C (Castagnoli, RFC 3720) by
``google-crc32c`` (SSE4.2/ARMv8 instructions, ~16 GB/s against zlib CRC-32's ~6 GB/s here; it releases
the GIL), as replay's WAL uses."""

CHUNK_CHECKSUMS: dict[str, Callable[[bytes], int]] = {
    "crc32c": google_crc32c.value,
    "crc32": zlib.crc32,
    "": zlib.crc32,
}
"""Checksum algorithms a subscriber verifies, by ``checksum_kind``: ``crc32c`` (what senders write) and,
still accepted so learner and rollouts can be upgraded in either order, zlib's CRC-32 under ``crc32`` or
an empty kind (senders from before ``WeightChunk.checksum_kind`` existed). Any other kind is refused."""


# The assembler's tensors are read-only memory by design (``ChunkAssembler``): torch's warning about it,
# raised in this module only, is not for the caller. A filter added once (``catch_warnings`` is not thread-safe).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__.replace(".", r"\."))


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
    data: bytes | memoryview
    nbytes: int
    """Byte size of the whole tensor."""
    last_of_tensor: bool = False
    checksum: int = 0
    """Checksum (unsigned 32-bit, under ``checksum_kind``) of the whole tensor's bytes; set on its last chunk."""
    last_of_version: bool = False
    num_tensors: int = 0
    """Number of tensors in the version; set on the version's last chunk."""
    checksum_kind: str = CHUNK_CHECKSUM_KIND
    """Algorithm of ``checksum``, a key of ``CHUNK_CHECKSUMS``; the same on every chunk of a tensor."""
    timeline: int = 0
    """Timeline of ``version`` (``proto.timeline``), the same on every chunk of a version."""
    chunk_checksum: int | None = None
    """``chunk_checksum(data)`` (XXH3-64) set by the learner, checked on arrival by every relay and subscriber;
    ``None`` from senders before it existed."""
    encoding: str = ""
    """``""``: ``data`` is the tensor's raw bytes; ``proto.sparse_delta.ENCODING``: a delta against the same tensor of
    ``base`` (``nbytes`` is then the delta's size; ``checksum`` still the CRC-32C of the rebuilt tensor)."""
    base: tuple[int, int] | None = None
    """``(version, timeline)`` the version was sent relative to (on every chunk of it), or ``None``."""


def chunk_checksum(data: bytes | memoryview) -> int:
    """XXH3-64 of one chunk's bytes (unsigned 64-bit; ``xxhash``: reads a ``memoryview`` in place, ~70 GB/s
    here). Per chunk, where CRC-32C guards whole tensors: a relay forwarding a chunk it cannot have verified
    whole yet is still caught by the next hop."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor flattened to bytes once per version, shared by every subscriber's stream."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview
    """Read-only view of the tensor's raw little-endian bytes (a private ``bytes`` copy): chunks slice it
    without copying."""
    checksum: int
    """CRC-32C (``CHUNK_CHECKSUM_KIND``) of ``data``."""
    encoding: str = ""
    """``""``: ``data`` is the raw tensor; ``proto.sparse_delta.ENCODING``: ``data`` is a delta (``checksum`` is still
    the whole tensor's)."""
    chunk_sums: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)
    """``chunk_bytes`` → ``chunk_checksum`` of each chunk, computed once per chunk size (``iter_chunks``)."""

    def chunk_checksums(self, chunk_bytes: int) -> list[int]:
        """``chunk_checksum`` of each ``chunk_bytes`` piece of ``data`` (cached; a race computes it twice)."""
        sums = self.chunk_sums.get(chunk_bytes)
        if sums is None:
            n = len(self.data)
            sums = [chunk_checksum(self.data[o:o + chunk_bytes]) for o in range(0, max(n, 1), chunk_bytes)]
            self.chunk_sums[chunk_bytes] = sums
        return sums


def encode_tensors(named: list[tuple[str, torch.Tensor]]) -> list[EncodedTensor]:
    """Snapshot tensors to private CPU bytes (the learner may step its weights right after) and
    checksum them with CRC-32C; one copy per tensor. Raises ``ChunkError`` for an unsupported dtype."""
    by_dtype = {v: k for k, v in DTYPES.items()}
    out = []
    for name, t in named:
        if t.dtype not in by_dtype:
            raise ChunkError(f"tensor {name!r} has dtype {t.dtype}; supported: {sorted(DTYPES)}")
        # bytes: an immutable private copy (numpy's tobytes copies ~5x faster than torch's clone here)
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out.append(EncodedTensor(name, by_dtype[t.dtype], tuple(t.shape), memoryview(raw),
                                 CHUNK_CHECKSUMS[CHUNK_CHECKSUM_KIND](raw)))
    return out


def iter_chunks(version: int, tensors: list[EncodedTensor], chunk_bytes: int,
                timeline: int = 0, base: tuple[int, int] | None = None) -> Iterator[TensorChunk]:
    """Cut a version (of ``timeline``; sent relative to ``base``, whose delta tensors say so in ``encoding``) into
    chunks of at most ``chunk_bytes`` bytes, tensors in order."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes ({chunk_bytes}) must be >= 1")
    for i, t in enumerate(tensors):
        n = len(t.data)
        offsets = range(0, max(n, 1), chunk_bytes)
        for offset, sum64 in zip(offsets, t.chunk_checksums(chunk_bytes)):
            last = offset + chunk_bytes >= n
            yield TensorChunk(
                version=version, name=t.name, dtype=t.dtype, shape=t.shape, offset=offset,
                data=t.data[offset:offset + chunk_bytes], nbytes=n, last_of_tensor=last,
                checksum=t.checksum if last else 0,
                last_of_version=last and i == len(tensors) - 1,
                num_tensors=len(tensors) if last and i == len(tensors) - 1 else 0,
                checksum_kind=CHUNK_CHECKSUM_KIND, timeline=timeline, chunk_checksum=sum64,
                encoding=t.encoding, base=base,
            )


class ChunkAssembler:
    """Stages the chunks of one version; returns the named tensors once all are verified.

    Staging holds each received chunk's ``data`` (a view of its message) until the tensor's last chunk,
    then joins them into one private ``bytes`` (one copy, no zero-fill pass: a preallocated ``bytearray``
    cost a memset plus the copy) and checksums that with the GIL released. Peak staging memory is twice
    the largest tensor, for the moment of the join. Ownership: every returned tensor is a view of its own
    immutable ``bytes``, referenced by nothing else, which the assembler never touches again (nothing is
    reused between versions) — the caller owns it for as long as it wants. It is read-only memory (the
    engine copies weights out of it): writing into it is not supported.
    """

    def __init__(self, base: tuple[int, int, dict[str, bytes]] | None = None) -> None:
        self.base = base
        """``(version, timeline, {name: raw bytes})`` a delta tensor is applied to (``proto.sparse_delta``)."""
        self.raw: dict[str, bytes] = {}
        """Raw bytes of each tensor of the newest complete version (a delta's base for the next one)."""
        self._reset()

    def _reset(self) -> None:
        self.version: int | None = None
        self._parts: list[bytes | memoryview] = []
        self._filled = 0
        self._current: TensorChunk | None = None
        self._done: list[tuple[str, torch.Tensor]] = []
        self._raw: dict[str, bytes] = {}

    def feed(self, chunk: TensorChunk) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """Add a chunk; returns ``(version, [(name, tensor)])`` after the version's last chunk.

        Raises:
            ChunkError: version change mid-stream, offset gap, unknown dtype or checksum kind, size/shape
                mismatch, checksum mismatch, or a tensor count that disagrees. The partial version is
                discarded.
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
            if self._filled:
                raise ChunkError(f"tensor {self._current.name!r} ended without its last chunk")
            self._current = c
        self._check_like_first(c)
        if c.offset != self._filled:
            raise ChunkError(f"tensor {c.name!r}: chunk at offset {c.offset}, expected {self._filled}")
        if c.offset == 0:
            _check_size(c)  # before staging what the chunk claims
        if c.chunk_checksum is not None and chunk_checksum(c.data) != c.chunk_checksum:
            raise ChunkError(f"tensor {c.name!r}: chunk at offset {c.offset} ({len(c.data)} bytes) fails its "
                             f"checksum (XXH3-64 {chunk_checksum(c.data):#018x} != sent {c.chunk_checksum:#018x})")
        end = c.offset + len(c.data)
        if end > c.nbytes:
            raise ChunkError(f"tensor {c.name!r}: chunk ends at byte {end}, tensor has {c.nbytes} bytes")
        if len(c.data):
            self._parts.append(c.data)
        self._filled = end
        if not c.last_of_tensor:
            return None
        self._done.append((c.name, self._finish_tensor(c)))
        self._parts, self._filled = [], 0
        if not c.last_of_version:
            return None
        if c.num_tensors != len(self._done):
            raise ChunkError(f"version {c.version}: {len(self._done)} tensors received, {c.num_tensors} sent")
        version, tensors, self.raw = self.version, self._done, self._raw
        self._reset()
        return version, tensors

    def _check_like_first(self, c: TensorChunk) -> None:
        first = self._current
        if (c.dtype, tuple(c.shape), c.nbytes, c.checksum_kind, c.encoding, c.base) != (
                first.dtype, tuple(first.shape), first.nbytes, first.checksum_kind, first.encoding, first.base):
            raise ChunkError(f"tensor {c.name!r}: chunk at offset {c.offset} says dtype {c.dtype}, shape "
                             f"{list(c.shape)}, {c.nbytes} bytes, checksum {c.checksum_kind!r}, encoding "
                             f"{c.encoding!r} against {c.base}; its first chunk said dtype {first.dtype}, shape "
                             f"{list(first.shape)}, {first.nbytes} bytes, checksum {first.checksum_kind!r}, "
                             f"encoding {first.encoding!r} against {first.base}")
        if c.dtype not in DTYPES:
            raise ChunkError(f"tensor {c.name!r}: unknown dtype {c.dtype!r}; expected one of {sorted(DTYPES)}")
        if c.checksum_kind not in CHUNK_CHECKSUMS:
            raise ChunkError(f"tensor {c.name!r}: unknown checksum kind {c.checksum_kind!r}; expected one of "
                             f"{sorted(CHUNK_CHECKSUMS)}")

    def _finish_tensor(self, c: TensorChunk) -> torch.Tensor:
        if self._filled != c.nbytes:
            raise ChunkError(f"tensor {c.name!r}: {self._filled} bytes received, {c.nbytes} expected")
        raw = b"".join(self._parts)  # the one copy: uninitialised bytes filled once, no zero-fill pass
        if c.encoding:
            raw = self._undelta(c, raw)
        self._raw[c.name] = raw
        crc = CHUNK_CHECKSUMS[c.checksum_kind](raw)
        if crc != c.checksum:
            raise ChunkError(f"tensor {c.name!r}: checksum {crc:#010x} != sent {c.checksum:#010x} "
                             f"({c.checksum_kind or 'crc32'})")
        dtype = DTYPES[c.dtype]
        _check_size(dataclasses.replace(c, nbytes=len(raw), encoding=""))
        if not raw:
            return torch.empty(c.shape, dtype=dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(c.shape)


    def _undelta(self, c: TensorChunk, delta: bytes) -> bytes:
        """The tensor ``delta`` rebuilds from this assembler's base (checked by the caller against its CRC-32C)."""
        if c.encoding != sparse_delta.ENCODING:
            raise ChunkError(f"tensor {c.name!r}: unknown encoding {c.encoding!r}; expected '' or "
                             f"{sparse_delta.ENCODING!r}")
        held = None if self.base is None else self.base[:2]
        if held != c.base or c.name not in self.base[2]:
            raise ChunkError(f"tensor {c.name!r}: a delta against version {c.base}, but this subscriber holds "
                             f"{held if held is not None else 'no base'}"
                             f"{'' if held != c.base else ' without that tensor'}")
        try:
            return sparse_delta.apply_delta(self.base[2][c.name], delta, DTYPES[c.dtype].itemsize)
        except sparse_delta.DeltaError as exc:
            raise ChunkError(f"tensor {c.name!r}: {exc}") from exc


def _check_size(c: TensorChunk) -> None:
    if any(d < 0 for d in c.shape):
        raise ChunkError(f"tensor {c.name!r}: shape {list(c.shape)} has a negative dimension")
    if c.nbytes > MAX_TENSOR_BYTES:
        raise ChunkError(f"tensor {c.name!r}: {c.nbytes} bytes is over the {MAX_TENSOR_BYTES}-byte limit per tensor")
    numel = 1
    for d in c.shape:
        numel *= d
    full = numel * DTYPES[c.dtype].itemsize
    if c.encoding and c.nbytes >= full:
        raise ChunkError(f"tensor {c.name!r}: a {c.nbytes}-byte delta of a {full}-byte tensor (never sent: not smaller)")
    if not c.encoding and full != c.nbytes:
        raise ChunkError(f"tensor {c.name!r}: shape {list(c.shape)} × {c.dtype} != {c.nbytes} bytes")
