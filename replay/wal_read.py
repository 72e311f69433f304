"""Reading WAL segments back: valid records, where they end, and whether a bad tail is torn or corrupt.

A segment is read message by message (``pa.ipc.read_message``) so the byte offset where the valid
prefix ends is known. The first record that cannot be read or fails its checksum ends the prefix. What
follows decides what it was:

- nothing decodable after it, in the newest segment → a **torn tail**: the crash hit the middle of an
  append, that record was never acknowledged, and dropping it is correct (logged at info);
- a decodable record after it, or later segments → **corruption**: acknowledged data may be behind
  it. Restore stops at the last good record and names the file, offset and what was discarded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from gyre.replay.records import (RECORD_SCHEMA, RECORD_SCHEMAS, WAL_FORMAT_VERSION, CorruptRecordError, Record,
                            decode, end_of_stream, record_format)
from gyre.replay.wal import SEGMENT_SUFFIX

_CONTINUATION = b"\xff\xff\xff\xff"
_EOS = end_of_stream()


@dataclass(frozen=True)
class SegmentScan:
    """What one segment file holds."""

    path: Path
    first_lsn: int
    """LSN of the segment's first record (from the file name)."""
    records: list[Record] = field(repr=False)
    """The valid prefix, in LSN order."""
    ends: list[int] = field(repr=False)
    """Byte offset just after each record of ``records``."""
    header_bytes: int
    """Byte length of the segment header (0 if it is unreadable)."""
    good_bytes: int
    """Byte length of the valid prefix (header + good records [+ end-of-stream])."""
    size: int
    """File size in bytes."""
    error: str | None = None
    """Why reading stopped before the end of the file, or ``None``."""
    valid_after_error: bool = False
    """A decodable record exists after the bad one (so this is corruption, not a torn tail)."""


def _read_record(reader: pa.BufferReader, fmt: int) -> Record:
    msg = pa.ipc.read_message(reader)
    return decode(pa.ipc.read_record_batch(msg, RECORD_SCHEMAS[fmt]), fmt)


def _decodable_after(buf: pa.Buffer, start: int, fmt: int = WAL_FORMAT_VERSION) -> bool:
    data = buf.to_pybytes()
    pos = data.find(_CONTINUATION, start + 1)
    while pos != -1:
        try:
            _read_record(pa.BufferReader(buf.slice(pos)), fmt)
            return True
        except (OSError, EOFError, ValueError, pa.ArrowException):
            pos = data.find(_CONTINUATION, pos + 1)
    return False


def read_segment(path: Path) -> SegmentScan:
    """Read a segment's valid prefix (memory-mapped; payloads are zero-copy views of the file)."""
    first_lsn = first_lsn_of(path)
    with pa.memory_map(str(path)) as mm:
        buf = mm.read_buffer()
    reader = pa.BufferReader(buf)
    records: list[Record] = []
    ends: list[int] = []
    try:
        schema = pa.ipc.read_schema(pa.ipc.read_message(reader))
    except (OSError, EOFError, ValueError, pa.ArrowException) as exc:
        return SegmentScan(path, first_lsn, records, ends, 0, 0, buf.size, f"unreadable segment header: {exc}",
                           any(_decodable_after(buf, 0, fmt) for fmt in RECORD_SCHEMAS))
    fmt = record_format(schema)
    if fmt is None:
        return SegmentScan(path, first_lsn, records, ends, 0, 0, buf.size,
                           f"segment header has schema {schema} / {schema.metadata}; expected WAL format "
                           f"{sorted(RECORD_SCHEMAS)} ({RECORD_SCHEMA})")
    good = header = reader.tell()
    error = None
    while reader.tell() < buf.size:
        try:
            records.append(_read_record(reader, fmt))
            ends.append(reader.tell())
        except EOFError:  # the end-of-stream marker of a cleanly closed segment
            good = reader.tell()
            if good < buf.size:
                error = f"{buf.size - good} bytes after the end-of-stream marker"
            break
        except (OSError, ValueError, CorruptRecordError, pa.ArrowException) as exc:
            error = f"record {first_lsn + len(records)} at byte {good}: {exc}"
            break
        good = reader.tell()
    # A segment that ends with the end-of-stream marker was closed cleanly: nothing in it is torn.
    closed = buf.size >= good + len(_EOS) and buf.slice(buf.size - len(_EOS)).to_pybytes() == _EOS
    after = (closed or _decodable_after(buf, good, fmt)) if error else False
    return SegmentScan(path, first_lsn, records, ends, header, good, buf.size, error, after)


def first_lsn_of(path: Path) -> int:
    """LSN of a segment's first record, from its file name."""
    return int(path.name[: -len(SEGMENT_SUFFIX)])


def list_segments(wal_dir: Path) -> list[Path]:
    """Segment files in LSN order (files with other names are ignored)."""
    if not wal_dir.is_dir():
        return []
    out = []
    for p in wal_dir.glob(f"*{SEGMENT_SUFFIX}"):
        stem = p.name[: -len(SEGMENT_SUFFIX)]
        if stem.isdigit():
            out.append(p)
    return sorted(out, key=first_lsn_of)
