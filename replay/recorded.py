"""Record once, train many: a finished run's replay directory read as the stream of groups its learner consumed,
and a fresh replay directory holding that stream for another learner.

**The recorded order** (``read_recording``): the groups of every lease the recorded learner acknowledged, in the
order those leases were taken (the WAL order of their ``lease`` records), each lease's groups in hand-out order. A
learner acknowledges a lease once the checkpoint that trained on it commits, so this is what the recorded learner
trained on, batch by batch; a lease released or expired (a learner crash) is not part of it, and its groups count
at the acknowledged lease that took them again. A group acknowledged twice (``max_times_sampled > 1``) counts once,
at its first. Groups the recorded learner never consumed (still pooled or leased at the end, dropped as too stale,
evicted) are not part of the recording.

**How it is read.** Every WAL record from LSN 0 on is checked and applied to an empty ``ReplayState`` with the
recorded run's replay config — the function the live buffer and restore apply records with, so a lease's group
keys name the groups they named in the recorded run. Each record's CRC-32C is checked (``replay.wal_read``); a torn
last record (never acknowledged) ends the stream; any other bad record, a gap in LSNs, a record that does not apply
or a snapshot that fails verification (``replay.snapshot.load_snapshot``) refuses the whole recording
(``RecordingError``). The WAL must start at LSN 0: a snapshot deletes the segments it covers unless the recorded
run set ``replay.wal.keep_segments``. Nothing in the recording's directory is written, moved or truncated.

**The copy** (``write_replay_dir``): the groups are inserted, in the recorded order, into an empty directory through
a ``TrajectoryBuffer`` (so it has a WAL like any replay directory, and the replay service restores it as usual),
under the config ``recorded_replay_config`` derives: groups keep their recorded rows (tokens, behaviour logprobs,
rewards, policy-version spans), get keys in the recorded order, and a FIFO selector with no staleness gate hands
them out in that order to any learner, whatever its policy version. ``RECORDING_MANIFEST`` records where they came
from.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.replay.files import fsync_dir
from gyre.replay.snapshot import list_snapshots, load_snapshot
from gyre.replay.state import ReplayState
from gyre.replay.types import SnapshotError
from gyre.replay.wal_read import first_lsn_of, list_segments, read_segment

RECORDING_MANIFEST = "recording.json"
"""File, in a replay directory built by ``write_replay_dir``, naming the recording it holds a copy of."""
NO_STALENESS_GATE = 2**62
"""``max_staleness`` of a replay that serves a recording: no learner version ever makes a recorded group too stale."""
INSERT_BYTES = 32 * 1024 * 1024
"""Largest insert (Arrow bytes of its rows) ``write_replay_dir`` makes: the copy goes in as few WAL records as that allows."""


class RecordingError(ValueError):
    """A recording that cannot be trained from: missing, incomplete or corrupt; the message names the path and why."""


@dataclass(frozen=True)
class Recording:
    """The groups a recorded learner consumed, in the recorded order (module docstring)."""

    dir: Path
    """The recorded replay directory."""
    groups: list[pa.Table]
    """Each group's ``[n]`` rows (``TRAJECTORY_SCHEMA``), as the recorded run stored them, in the recorded order."""
    group_ids: list[str]
    """``group_ids[i]`` is the ``group_id`` of ``groups[i]``."""
    files: dict[str, str]
    """Every file of the directory that was read (path relative to ``dir``) → its sha256 (hex)."""
    wal_records: int
    """WAL records applied."""
    torn_tail_bytes: int = 0
    """Bytes of a torn last record (a crash mid-append, never acknowledged) that were not read."""

    @property
    def trajectory_ids(self) -> list[str]:
        """The ``trajectory_id`` of every row, group by group in the recorded order."""
        return [t for g in self.groups for t in g.column("trajectory_id").to_pylist()]


def sha256_files(root: Path) -> dict[str, str]:
    """sha256 (hex) of every file under ``root``, by path relative to it (sorted; symlinks not followed)."""
    out = {}
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink()):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        out[str(path.relative_to(root))] = digest.hexdigest()
    return out


def read_recording(config: ReplayConfig) -> Recording:
    """Read the recorded replay directory ``config.dir`` (``config``: the recorded run's replay config) into the
    groups its learner consumed, in the recorded order (module docstring). Only reads.

    Raises:
        RecordingError: no such directory, no WAL, a WAL that does not start at LSN 0, a corrupt snapshot or WAL
            record, an LSN gap, a record that does not apply, or no group was ever consumed; naming the file.
    """
    if config.dir is None:
        raise RecordingError("the recorded replay config has no dir (an in-memory replay records nothing)")
    root = Path(config.dir)
    if not root.is_dir():
        raise RecordingError(f"replay directory {root} does not exist")
    segments = list_segments(root / "wal")
    if not segments:
        raise RecordingError(f"replay directory {root} holds no WAL segment (wal/*.arrows): nothing was recorded")
    first = first_lsn_of(segments[0])
    if first != 0:
        raise RecordingError(f"replay directory {root} is not a whole recording: its WAL starts at LSN {first}, "
                             "not 0 (snapshots deleted the older segments); record with replay.wal.keep_segments: true")
    for snap in list_snapshots(root / "snapshots"):
        try:
            load_snapshot(snap)
        except SnapshotError as exc:
            raise RecordingError(f"corrupt recording: {exc}") from None
    files = sha256_files(root)
    group_ids, groups, records, torn = _consumed(config, segments)
    if not groups:
        raise RecordingError(f"replay directory {root}: its learner acknowledged no lease ({records} WAL records); "
                             "there is nothing to train on")
    return Recording(root, groups, group_ids, files, records, torn)


def _consumed(config: ReplayConfig, segments: list[Path]) -> tuple[list[str], list[pa.Table], int, int]:
    """Apply every record of ``segments`` (from LSN 0) to an empty state; returns ``(group ids, their rows, records
    applied, torn tail bytes)`` of the acknowledged leases' groups in the recorded order."""
    state = ReplayState(config.model_copy(update={"dir": None}), time.time, random.Random(0))
    leases: dict[str, list[tuple[str, pa.Table]]] = {}
    """lease id → its groups, in the order the leases were taken."""
    acked: set[str] = set()
    expected, torn = 0, 0
    for i, path in enumerate(segments):
        scan = read_segment(path)
        if scan.first_lsn != expected:
            raise RecordingError(f"corrupt recording: WAL segment {path} starts at LSN {scan.first_lsn}; the one "
                                 f"before ended at {expected - 1} (a gap)")
        for rec in scan.records:
            try:
                state.check(rec)
                if rec.kind == "lease":
                    stored = [state.store.groups[k] for k in rec.meta["keys"]]
                    leases[rec.meta["lease_id"]] = [(g.group_id, g.table) for g in stored]
                elif rec.kind == "ack":
                    acked.update(rec.meta["lease_ids"])
                state.apply(rec)
            except (KeyError, ValueError) as exc:
                raise RecordingError(f"corrupt recording: WAL segment {path}: record {expected} ({rec.kind}) does "
                                     f"not apply: {exc}") from None
            expected += 1
        if scan.error is not None:
            if i + 1 == len(segments) and not scan.valid_after_error:
                torn = scan.size - scan.good_bytes  # a crash mid-append: that record was never acknowledged
                break
            raise RecordingError(f"corrupt recording: WAL segment {path}: {scan.error}")
    ordered: dict[str, pa.Table] = {}
    """group id → its rows, at its first acknowledged lease."""
    for lease_id, got in leases.items():
        if lease_id in acked:
            for gid, rows in got:
                ordered.setdefault(gid, rows)
    return list(ordered), list(ordered.values()), expected, torn


def recorded_replay_config(config: ReplayConfig, num_groups: int) -> ReplayConfig:
    """The replay config of a run that trains from a recording of ``num_groups`` groups: ``config`` (the run's own,
    with ``source`` set) with the staleness gate off (``NO_STALENESS_GATE``: a learner's version, which differs
    between learners, must not change what is consumed), room for every group (``capacity_groups``) and no bound on
    the prompt ledger (``num_prompts``: nothing is generated for training)."""
    return config.model_copy(update={"max_staleness": NO_STALENESS_GATE, "num_prompts": None,
                                     "capacity_groups": max(config.capacity_groups, num_groups)})


def _chunks(groups: list[pa.Table]) -> list[list[pa.Table]]:
    """Consecutive groups of one schema, up to ``INSERT_BYTES`` per chunk (at least one group each)."""
    out: list[list[pa.Table]] = []
    size = 0
    for g in groups:
        if out and size + g.nbytes <= INSERT_BYTES and g.schema.equals(out[-1][0].schema, check_metadata=True):
            out[-1].append(g)
            size += g.nbytes
        else:
            out.append([g])
            size = g.nbytes
    return out


def write_replay_dir(recording: Recording, config: ReplayConfig, dest: Path, manifest: dict) -> Path:
    """Build ``dest``, a replay directory holding ``recording``'s groups in the recorded order (module docstring),
    with ``config`` (``recorded_replay_config``; its ``dir`` is ignored). Built beside ``dest`` and renamed into place
    once complete, with ``RECORDING_MANIFEST`` (``manifest`` plus the group ids and counts): a crash leaves no
    half-built directory behind. Returns ``dest``.

    Raises:
        RecordingError: ``dest`` exists and is not empty, or a recorded group is not stored as it was (a
            duplicate group id or prompt index in the recording).
    """
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise RecordingError(f"replay directory {dest} exists and is not empty; a recording is copied into an "
                             "empty one only")
    tmp = dest.with_name(f".{dest.name}.building")
    shutil.rmtree(tmp, ignore_errors=True)  # a build a crash interrupted
    buffer = TrajectoryBuffer(config.model_copy(update={"dir": str(tmp)}))
    try:
        for chunk in _chunks(recording.groups):
            table = pa.concat_tables(chunk)
            result = buffer.insert(table)
            if result.accepted != table.num_rows:
                raise RecordingError(f"recording {recording.dir}: {table.num_rows - result.accepted} of "
                                     f"{table.num_rows} recorded trajectories were not stored again ({result}): "
                                     "a group id or prompt index appears twice in the recording")
    finally:
        buffer.close()
    body = {**manifest, "recording_dir": str(recording.dir), "groups": recording.group_ids,
            "trajectories": sum(g.num_rows for g in recording.groups), "recording_files": recording.files,
            "wal_records": recording.wal_records, "created_at": time.time()}
    with open(tmp / RECORDING_MANIFEST, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    if dest.exists():
        dest.rmdir()
    os.rename(tmp, dest)
    fsync_dir(dest.parent)
    return dest


def read_manifest(replay_dir: Path) -> dict | None:
    """The ``RECORDING_MANIFEST`` of a replay directory built from a recording, or ``None`` if it has none.

    Raises:
        RecordingError: the manifest exists but is not a JSON object.
    """
    path = Path(replay_dir) / RECORDING_MANIFEST
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
    except ValueError as exc:
        raise RecordingError(f"{path} is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RecordingError(f"{path} must hold a JSON object, got {type(body).__name__}")
    return body
