"""WAL records: every state change of the replay buffer as one row of an Arrow record batch.

A WAL segment is one Arrow IPC stream with ``RECORD_SCHEMA``; each record is a one-row record batch
(``kind``, ``meta``, ``payload``, ``crc32c``), so any Arrow reader can open a segment. Inserts carry
the trajectories as Arrow IPC stream bytes in ``payload`` (the bytes the client sent, appended as they
are unless ``wal.compression="zstd"``); small records (leases, acks, ...) are always written
uncompressed — Arrow IPC records the compression per batch, so one stream mixes both.

The checksum covers ``kind``, ``meta`` and ``payload``; Arrow IPC itself has no checksum, so this is what
turns a flipped byte into a named error instead of silently different data. Format versions (in the
segment header's schema metadata ``gyre.wal_format``, which also names the algorithm in
``gyre.wal_checksum``): **2** (written) has a ``crc32c`` column, CRC-32C (Castagnoli, RFC 3720) by
``google-crc32c`` — SSE4.2/ARMv8 hardware, ~15 GB/s, 5x zlib's crc32 on a 0.5 MB insert; **1** (read
only, segments written before) has a ``crc32`` column, zlib's CRC-32. A segment is read with the
format its header declares, so a log that spans the upgrade restores.

Kinds and their ``meta`` (JSON object; keys are group keys, times are clock seconds):

==================  ======================================================================
``insert``          ``{}``; payload: the trajectories (whole groups)
``evict``           ``{"keys": [...]}`` capacity eviction, chosen by the eviction selector
``learner_version`` ``{"version": L}`` the learner's version rose (stale groups drop or are excluded)
``lease``           ``{"lease_id", "keys", "consumer", "expires_at"}`` a sample
``ack``             ``{"lease_ids": [...]}`` leases consumed
``release``         ``{"lease_ids": [...]}`` leases returned untouched
``expire``          ``{"lease_ids": [...]}`` leases past their deadline, returned
``rejoin``          ``{"consumer", "version", "timeline"?}`` a consumer resumed from a checkpoint: its
                    leases are returned and the learner version is set to ``version`` (it may go down); a
                    new ``timeline`` retires the previous learner's and deletes its dead groups
``prompt_lease``    ``{"consumer", "items": [[index, attempt], ...], "expires_at"}``
``prompt_expire``   ``{"items": [[index, next_attempt], ...]}``
``priority``        ``{"keys": [...], "priorities": [...]}``
==================  ======================================================================

No pickle: records are Arrow + JSON only.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field

import google_crc32c
import pyarrow as pa

from gyre.proto.trajectory import SCHEMA_VERSION, SCHEMA_VERSION_KEY

WAL_FORMAT_VERSION = 2
"""Format this writer produces; bumped on any incompatible change of ``RECORD_SCHEMA``, of a kind's
meta or of the checksum. ``RECORD_SCHEMAS`` lists every format a reader accepts."""

KINDS = frozenset({"insert", "evict", "learner_version", "lease", "ack", "release", "expire", "rejoin",
                   "prompt_lease", "prompt_expire", "priority"})


def _record_schema(version: int, checksum: str) -> pa.Schema:
    metadata = {b"gyre.wal_format": str(version).encode(), SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()}
    if version >= 2:
        metadata[b"gyre.wal_checksum"] = checksum.encode()
    return pa.schema([pa.field("kind", pa.utf8(), nullable=False), pa.field("meta", pa.utf8(), nullable=False),
                      pa.field("payload", pa.binary(), nullable=False),
                      pa.field(checksum, pa.uint32(), nullable=False)], metadata=metadata)


RECORD_SCHEMAS = {1: _record_schema(1, "crc32"), 2: _record_schema(2, "crc32c")}
"""WAL format version → the Arrow schema of its segments (their header message)."""
RECORD_SCHEMA = RECORD_SCHEMAS[WAL_FORMAT_VERSION]


def _crc32(kind: str, meta: str, payload) -> int:
    return zlib.crc32(payload, zlib.crc32(meta.encode(), zlib.crc32(kind.encode())))


def _crc32c(kind: str, meta: str, payload) -> int:
    return google_crc32c.extend(google_crc32c.extend(google_crc32c.value(kind.encode()), meta.encode()), payload)


_CHECKSUMS = {1: _crc32, 2: _crc32c}


def record_format(schema: pa.Schema) -> int | None:
    """The WAL format version whose schema (metadata included) ``schema`` is, else ``None``."""
    return next((v for v, known in RECORD_SCHEMAS.items() if schema.equals(known, check_metadata=True)), None)


_PLAIN = pa.ipc.IpcWriteOptions()
_ZSTD: dict[int, pa.ipc.IpcWriteOptions] = {}
_SCHEMA_MESSAGE = RECORD_SCHEMA.serialize().to_pybytes()
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


class CorruptRecordError(ValueError):
    """A WAL record failed its checksum or could not be decoded; the message says which check."""


@dataclass(frozen=True)
class Record:
    """One state change."""

    kind: str
    """One of ``KINDS``."""
    meta: dict = field(default_factory=dict)
    """Kind-specific plain values (see the module table)."""
    payload: bytes | pa.Buffer = b""
    """Arrow IPC stream bytes of the inserted trajectories (``insert`` only; a zero-copy buffer when read)."""


def segment_header() -> bytes:
    """The Arrow IPC schema message that starts every segment."""
    return _SCHEMA_MESSAGE


def end_of_stream() -> bytes:
    """The Arrow IPC end-of-stream marker written when a segment is closed cleanly."""
    return _EOS


def _zstd(level: int) -> pa.ipc.IpcWriteOptions:
    if level not in _ZSTD:
        _ZSTD[level] = pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=level))
    return _ZSTD[level]


class _PartsSink:
    """A write-only file for ``pa.PythonFile`` that keeps every piece Arrow writes, in order: Arrow's IPC
    writer hands each body buffer over as a ``pa.Buffer`` (zero-copy), so an insert's payload is not copied."""

    closed = False

    def __init__(self) -> None:
        self.parts: list = []

    def write(self, data) -> int:
        self.parts.append(data)
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _drop_prefix(parts: list, nbytes: int) -> list:
    """``parts`` without their first ``nbytes`` bytes (slicing the part the cut falls in)."""
    out = []
    for part in parts:
        size = memoryview(part).nbytes
        if nbytes >= size:
            nbytes -= size
            continue
        out.append(memoryview(part)[nbytes:] if nbytes else part)
        nbytes = 0
    return out


def encode_parts(record: Record, compression: str = "none", zstd_level: int = 1) -> list:
    """The Arrow IPC message of ``record`` as a one-row batch (appendable to any segment), as the list
    of bytes-like pieces Arrow's writer produced (their concatenation is the message; ``os.writev``
    writes them as one record). The payload is one of the pieces, uncopied, unless ``compression="zstd"``
    compresses a non-empty one at ``zstd_level``.

    Raises:
        ValueError: unknown kind or compression.
    """
    if record.kind not in KINDS:
        raise ValueError(f"unknown WAL record kind {record.kind!r}")
    if compression not in ("none", "zstd"):
        raise ValueError(f"WAL compression {compression!r} must be 'none' or 'zstd'")
    meta = json.dumps(record.meta, separators=(",", ":"))
    payload = pa.py_buffer(record.payload)
    offsets = pa.array([0, payload.size], pa.int32()).buffers()[1]
    batch = pa.record_batch(
        [pa.array([record.kind]), pa.array([meta]),
         pa.Array.from_buffers(pa.binary(), 1, [None, offsets, payload]),
         pa.array([_crc32c(record.kind, meta, payload)], pa.uint32())],
        schema=RECORD_SCHEMA)
    sink = _PartsSink()
    options = _zstd(zstd_level) if payload.size and compression == "zstd" else _PLAIN
    writer = pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), RECORD_SCHEMA, options=options)
    writer.write_batch(batch)
    parts = _drop_prefix(sink.parts, len(_SCHEMA_MESSAGE))  # the batch message, before the end-of-stream
    writer.close()
    return parts


def encode(record: Record, compression: str = "none", zstd_level: int = 1) -> pa.Buffer:
    """``encode_parts`` joined into one buffer (one copy; for small records and tests)."""
    return pa.py_buffer(b"".join(encode_parts(record, compression, zstd_level)))


def decode(batch: pa.RecordBatch, format_version: int = WAL_FORMAT_VERSION) -> Record:
    """A record from its one-row batch of a segment in WAL format ``format_version`` (which says the
    checksum). Raises ``CorruptRecordError`` (checksum, kind, JSON)."""
    schema = RECORD_SCHEMAS[format_version]
    if batch.num_rows != 1 or batch.schema.names != schema.names:
        raise CorruptRecordError(f"WAL batch has {batch.num_rows} rows and columns {batch.schema.names}")
    kind, meta = batch.column(0)[0].as_py(), batch.column(1)[0].as_py()
    payload = batch.column(2)[0].as_buffer()
    payload = payload if payload is not None else pa.py_buffer(b"")
    want = batch.column(3)[0].as_py()
    if _CHECKSUMS[format_version](kind, meta, payload) != want:
        raise CorruptRecordError(f"WAL record {kind!r} fails its {schema.names[3]} check (stored {want:#010x})")
    if kind not in KINDS:
        raise CorruptRecordError(f"unknown WAL record kind {kind!r}")
    try:
        parsed = json.loads(meta)
    except json.JSONDecodeError as exc:
        raise CorruptRecordError(f"WAL record {kind!r} meta is not JSON: {exc}") from exc
    return Record(kind, parsed, payload)
