"""Restore = newest valid snapshot + WAL tail. Never a silent cold start.

Algorithm (``restore``):

1. Remove leftovers of interrupted snapshot writes (``snapshots/.tmp-*``, ``.trash-*``).
2. Try snapshots newest first. A snapshot that fails verification (manifest, sizes, sha256, schemas)
   is logged as ``replay_snapshot_corrupt`` naming it and the check, moved to ``quarantine/``, and the
   next older one is tried. WAL segments are only deleted once the *oldest* kept snapshot covers them,
   so falling back one snapshot still finds every record it needs.
3. No usable snapshot: start from an empty state if the WAL begins at LSN 0 (nothing was ever
   compacted away); otherwise raise ``RestoreError`` naming every file that failed.
4. Replay WAL records with LSN >= the snapshot's, segment by segment, through ``ReplayState.apply``.
   A bad record at the very end of the newest segment with nothing decodable after it is a torn
   tail (never acknowledged): the segment is truncated there (logged at info). Any other bad record,
   or a gap in LSNs, is corruption: ``replay_wal_corrupt`` names the file, offset and reason, the
   state up to the last good record is kept, and the bad segment's tail and every later segment are
   copied to ``quarantine/``.
5. Re-base the rate limiter into the current config's window (``RateLimiter.load_state_dict``).

``read_only=True`` does all the reading and none of the writing (used by crash-test checkers).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from gyre.replay.snapshot import clean_temp, list_snapshots, load_snapshot
from gyre.replay.state import ReplayState
from gyre.replay.types import SnapshotError
from gyre.replay.files import fsync_dir
from gyre.replay.wal_read import SegmentScan, first_lsn_of, list_segments, read_segment

log = structlog.get_logger("replay")


class RestoreError(RuntimeError):
    """The directory holds replay data but no valid snapshot/WAL combination can be loaded."""


@dataclass
class RestoreReport:
    """What restore found and did."""

    next_lsn: int = 0
    """LSN the WAL writer continues from."""
    snapshot: str | None = None
    """Snapshot dir used, or ``None``."""
    snapshot_lsn: int = -1
    """The WAL position that snapshot covers (records below it), or -1."""
    snapshot_created_at: float | None = None
    records_replayed: int = 0
    torn_bytes_dropped: int = 0
    errors: list[str] = field(default_factory=list)
    """Corrupt snapshots/segments, one message each (also logged)."""
    quarantined: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _quarantine(root: Path, path: Path, read_only: bool, report: RestoreReport, move: bool = True) -> None:
    if read_only:
        return
    dest_dir = root / "quarantine"
    dest_dir.mkdir(exist_ok=True)
    dest = dest_dir / f"{time.time_ns()}-{path.name}"
    if move:
        os.rename(path, dest)
    else:
        shutil.copyfile(path, dest)
    report.quarantined.append(str(dest))


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())


def _load_newest_snapshot(state: ReplayState, root: Path, read_only: bool, report: RestoreReport) -> int:
    for snap in list_snapshots(root / "snapshots"):
        try:
            data = load_snapshot(snap)
            try:
                state.load_state_dict(data.state, data.groups)
            except (KeyError, ValueError, TypeError) as exc:
                state.reset()
                raise SnapshotError(f"snapshot {snap}: state.json does not load: {exc!r}") from exc
        except SnapshotError as exc:
            log.error("replay_snapshot_corrupt", snapshot=str(snap), error=str(exc))
            report.errors.append(str(exc))
            _quarantine(root, snap, read_only, report)
            continue
        report.snapshot, report.snapshot_created_at, report.snapshot_lsn = str(snap), data.created_at, data.lsn
        return data.lsn
    return -1


def _start_lsn(state: ReplayState, root: Path, segments: list[Path], read_only: bool, report: RestoreReport) -> int:
    start = _load_newest_snapshot(state, root, read_only, report)
    if start >= 0:
        return start
    first = first_lsn_of(segments[0]) if segments else 0
    if first > 0 or (report.errors and not segments):
        raise RestoreError(f"replay dir {root} holds data but nothing valid loads: "
                           f"{'; '.join(report.errors) or 'no snapshot'}; WAL segments "
                           f"{[p.name for p in segments]} start at LSN {first}, not 0")
    if report.errors:
        log.warning("replay_restore_from_wal_only", dir=str(root), reason="no valid snapshot; the WAL starts at 0")
    return 0


def _replay_segment(state: ReplayState, scan: SegmentScan, expected: int, report: RestoreReport):
    """Apply the scan's records from LSN ``expected`` on; returns ``(next expected, error, why)`` where
    ``why`` is ``None``, ``"read"`` (the scan stopped early), ``"apply"`` or ``"gap"``."""
    if scan.first_lsn > expected:
        return expected, f"LSN gap: expected record {expected}, the segment starts at {scan.first_lsn}", "gap"
    for j, rec in enumerate(scan.records):
        lsn = scan.first_lsn + j
        if lsn < expected:
            continue
        try:
            state.check(rec)
            state.apply(rec)  # an insert whose payload does not parse raises before it changes anything
        except (KeyError, ValueError) as exc:
            return expected, f"record {lsn} ({rec.kind}) does not apply: {exc}", "apply"
        expected = lsn + 1
        report.records_replayed += 1
    return expected, scan.error, "read" if scan.error else None


def _kept_bytes(scan: SegmentScan, expected: int) -> int:
    n = min(expected - scan.first_lsn, len(scan.records))
    return scan.ends[n - 1] if n > 0 else scan.header_bytes


def restore(state: ReplayState, root: Path, read_only: bool = False) -> RestoreReport:
    """Load ``root`` into the empty ``state``; returns what happened. Raises ``RestoreError``."""
    t0, report, root = time.monotonic(), RestoreReport(), Path(root)
    if not read_only:
        clean_temp(root / "snapshots")
    segments = list_segments(root / "wal")
    start = expected = _start_lsn(state, root, segments, read_only, report)
    for i, seg in enumerate(segments):
        last = i + 1 == len(segments)
        if not last and first_lsn_of(segments[i + 1]) <= start:
            continue  # fully covered by the snapshot
        scan = read_segment(seg)
        expected, error, why = _replay_segment(state, scan, expected, report)
        if why is None:
            continue
        if last and why == "read" and not scan.valid_after_error:
            log.info("replay_wal_torn_tail", segment=str(seg), dropped_bytes=scan.size - scan.good_bytes, error=error)
            report.torn_bytes_dropped += scan.size - scan.good_bytes
            if not read_only:
                _truncate(seg, _kept_bytes(scan, expected))
            break
        later = segments[i + 1:]
        log.error("replay_wal_corrupt", segment=str(seg), error=error, kept_up_to_record=expected - 1,
                  quarantined_segments=[p.name for p in later])
        report.errors.append(f"WAL segment {seg}: {error}; state kept up to record {expected - 1}")
        if why == "gap":  # nothing of this segment applies: set it aside whole
            _quarantine(root, seg, read_only, report)
        else:
            _quarantine(root, seg, read_only, report, move=False)
            if not read_only:
                _truncate(seg, _kept_bytes(scan, expected))
        for path in later:
            _quarantine(root, path, read_only, report)
        if not read_only:
            fsync_dir(root / "wal")
        break
    state.limiter.load_state_dict(state.limiter.state_dict())
    report.next_lsn, report.seconds = expected, time.monotonic() - t0
    log.info("replay_restored", dir=str(root), snapshot=report.snapshot, records_replayed=report.records_replayed,
             next_lsn=expected, seconds=round(report.seconds, 3), errors=len(report.errors))
    return report
