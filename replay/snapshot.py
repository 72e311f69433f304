"""Snapshots: the live set compacted into Arrow files plus a manifest, committed atomically.

Layout of ``{dir}/snapshots/snap-{lsn:020d}/`` (the snapshot covers every WAL record below ``lsn``):

- ``trajectories.arrow``: every stored row (pooled, leased, excluded), in group key order, an Arrow IPC
  *file* with ``TRAJECTORY_SCHEMA`` and the configured buffer compression;
- ``groups.arrow``: one row per group: key, group id, prompt index, oldest version, row count, Arrow
  bytes, state, times sampled, priority (group ``i``'s rows follow group ``i - 1``'s in the trajectories);
- ``state.json``: plain values: counters, rate limiter, prompt ledger, leases, learner version, next key;
- ``manifest.json`` (written last): snapshot format and trajectory schema versions, the LSN, sha256 and
  size of each file, the sha256 of the replay config (for forensics; a changed config still loads),
  group/trajectory counts and the lifetime counters.

Snapshots are a copy of what the WAL already holds (the WAL is made durable up to ``lsn`` first), so
a crash mid-snapshot loses nothing; they exist so restore and disk use do not grow with run length.

Commit protocol: write everything into ``.tmp-*``, fsync each file, fsync the temp dir, rename it to
``snap-{lsn}``, fsync ``snapshots/``. A crash at any point leaves either no new snapshot (the temp dir
is removed at the next start) or a complete one. Loading checks the manifest (versions, sizes,
hashes) and the files' schemas; any failure raises ``SnapshotError`` naming the file and the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import numpy as np
import pyarrow as pa

from gyre.proto.trajectory import SCHEMA_VERSION, TRAJECTORY_SCHEMA
from gyre.proto.trajectory_upgrade import UPGRADABLE, V3_SCHEMA, upgrade
from gyre.faults import fault_point
from gyre.replay.types import Group, SnapshotError
from gyre.replay.files import HashingFile, ForegroundGate, fsync_dir, read_verified, remove_gently

SNAPSHOT_FORMAT_VERSION = 1
GROUPS_SCHEMA = pa.schema([
    ("key", pa.int64()), ("group_id", pa.utf8()), ("prompt_index", pa.int64()), ("oldest_version", pa.int64()),
    ("num_rows", pa.int64()), ("nbytes", pa.int64()), ("state", pa.utf8()), ("times_sampled", pa.int64()),
    ("priority", pa.float64()),
])
_ROWS_PER_BATCH = 65536
_GROUPS_PER_BATCH = 1024
"""Groups per record batch of ``groups.arrow`` and per step of ``_runs``: each step is C-level list
building and conversion that holds the GIL throughout (~0.3 ms per 1024 groups), so the insert
threads get the GIL between steps (one step over 125k groups held it ~20 ms)."""


@dataclass(frozen=True)
class SnapshotData:
    """Everything a snapshot holds, in memory."""

    lsn: int
    """The snapshot covers WAL records ``< lsn``."""
    groups: list[Group]
    """Stored groups in key order."""
    state: dict
    """Plain values (see ``ReplayState.state_dict``)."""
    created_at: float | None = None
    """Wall-clock seconds when the snapshot was written (set when loaded)."""


def _write_arrow(path: Path, schema: pa.Schema, batches, compression: str | None,
                 gate: ForegroundGate | None = None, drop_cache: bool = False) -> dict:
    sink = HashingFile(path, gate, drop_cache)
    try:
        with pa.ipc.new_file(sink.sink, schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as writer:
            for batch in batches:
                writer.write_batch(batch)  # native: the GIL is released while Arrow encodes and writes
                sink.written()
    finally:
        sink.close()
    return {"sha256": sink.sha.hexdigest(), "bytes": sink.size}


def _write_json(path: Path, obj) -> dict:
    data = json.dumps(obj, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _runs(groups: list[Group]):
    """``(source table, start, rows)`` runs: adjacent groups stored contiguously in one source merge
    (vectorised: a snapshot of 1M trajectories walks ~125k groups but only one run per insert). Done
    ``_GROUPS_PER_BATCH`` groups at a time, so no single C-level pass holds the GIL for long (a run
    that spans two chunks is yielded as two runs)."""
    for at in range(0, len(groups), _GROUPS_PER_BATCH):
        chunk = groups[at: at + _GROUPS_PER_BATCH]
        n = len(chunk)
        sources = list(map(attrgetter("source"), chunk))
        ids = np.fromiter(map(id, sources), np.int64, n)
        offsets = np.fromiter(map(attrgetter("offset"), chunk), np.int64, n)
        rows = np.fromiter(map(attrgetter("num_rows"), chunk), np.int64, n)
        starts = np.flatnonzero(np.r_[True, (ids[1:] != ids[:-1]) | (offsets[1:] != offsets[:-1] + rows[:-1])])
        for i, total in zip(starts.tolist(), np.add.reduceat(rows, starts).tolist()):
            yield sources[i], int(offsets[i]), total


def _trajectory_batches(groups: list[Group]):
    """The groups' rows in key order as record batches. A run of at least 64 rows that is one slice
    of a source table (the insert the groups arrived in, or the snapshot they were restored from) is
    written as a zero-copy slice; the rest is gathered into batches of about ``_ROWS_PER_BATCH`` rows."""
    loose: list[pa.Table] = []
    loose_rows = 0
    for src, start, rows in _runs(groups):
        if rows >= 64:
            if loose:
                yield from pa.concat_tables(loose).combine_chunks().to_batches()
                loose, loose_rows = [], 0
            yield from src.slice(start, rows).to_batches()
            continue
        loose.append(src.slice(start, rows))
        loose_rows += rows
        if loose_rows >= _ROWS_PER_BATCH:
            yield from pa.concat_tables(loose).combine_chunks().to_batches()
            loose, loose_rows = [], 0
    if loose:
        yield from pa.concat_tables(loose).combine_chunks().to_batches()


def _groups_batches(groups: list[Group]):
    """``groups.arrow``'s record batches, ``_GROUPS_PER_BATCH`` groups each (one empty batch if none)."""
    for start in range(0, max(len(groups), 1), _GROUPS_PER_BATCH):
        chunk = groups[start: start + _GROUPS_PER_BATCH]
        cols = [list(map(attrgetter(f.name), chunk)) for f in GROUPS_SCHEMA]
        yield pa.record_batch([pa.array(c, f.type) for c, f in zip(cols, GROUPS_SCHEMA)], schema=GROUPS_SCHEMA)


def write_snapshot(root: Path, data: SnapshotData, compression: str = "none", config_hash: str = "",
                   gate: ForegroundGate | None = None, drop_cache: bool = False) -> Path:
    """Commit ``data`` as ``root/snap-{lsn}`` (see the module protocol); returns its path. With ``gate``
    (the WAL's) the files' writeback lets the WAL's fsyncs go first; with ``drop_cache`` the Arrow
    files leave the page cache as they are written back (``HashingFile``).

    Raises:
        OSError: the disk refused a write; the temp dir is left for the next start to remove.
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"snap-{data.lsn:020d}"
    if final.exists():
        return final
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    codec = None if compression == "none" else compression
    files = {
        "trajectories.arrow": _write_arrow(tmp / "trajectories.arrow", TRAJECTORY_SCHEMA,
                                           _trajectory_batches(data.groups), codec, gate, drop_cache),
        "groups.arrow": _write_arrow(tmp / "groups.arrow", GROUPS_SCHEMA, _groups_batches(data.groups), codec, gate,
                                     drop_cache),
        "state.json": _write_json(tmp / "state.json", data.state),
    }
    fault_point("replay.snapshot.files_written")
    manifest = {"format_version": SNAPSHOT_FORMAT_VERSION, "schema_version": SCHEMA_VERSION, "lsn": data.lsn,
                "created_at": time.time(), "files": files, "config_sha256": config_hash,
                "groups": len(data.groups), "trajectories": sum(g.num_rows for g in data.groups),
                "counters": {k: v for k, v in data.state.get("counters", {}).items() if not isinstance(v, list)}}
    _write_json(tmp / "manifest.json", manifest)
    fsync_dir(tmp)
    fault_point("replay.snapshot.before_rename")
    os.rename(tmp, final)
    fsync_dir(root)
    fault_point("replay.snapshot.after_rename")
    return final


def list_snapshots(root: Path) -> list[Path]:
    """Committed snapshot dirs, newest (highest LSN) first."""
    if not root.is_dir():
        return []
    snaps = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("snap-") and p.name[5:].isdigit()]
    return sorted(snaps, key=lambda p: int(p.name[5:]), reverse=True)


def remove_snapshot(path: Path, gate: ForegroundGate | None = None) -> None:
    """Delete a snapshot dir: rename it away first so a crash never leaves a half-deleted ``snap-*``,
    then delete its files gently (``remove_gently``: WAL fsyncs do not wait behind one big unlink)."""
    trash = path.parent / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    fsync_dir(path.parent)
    for f in sorted(trash.iterdir()):
        if f.is_file():
            remove_gently(f, gate)
    shutil.rmtree(trash, ignore_errors=True)


def clean_temp(root: Path) -> list[Path]:
    """Remove leftovers of interrupted snapshot writes/deletes (``.tmp-*``, ``.trash-*``)."""
    gone = list(root.glob(".tmp-*")) + list(root.glob(".trash-*"))
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def _read_arrow(snap: Path, name: str, data: pa.Buffer, schema: pa.Schema) -> pa.Table:
    try:
        table = pa.ipc.open_file(data).read_all()
    except (OSError, pa.ArrowException) as exc:
        raise SnapshotError(f"snapshot {snap}: {name} is not a readable Arrow file: {exc}") from exc
    if not table.schema.equals(schema, check_metadata=True):
        raise SnapshotError(f"snapshot {snap}: {name} has schema {table.schema}; expected {schema}")
    return table


def load_snapshot(snap: Path) -> SnapshotData:
    """Verify and load one snapshot. Raises ``SnapshotError`` naming the file and the failed check."""
    try:
        manifest = json.loads((snap / "manifest.json").read_bytes())
        lsn, files = int(manifest["lsn"]), manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"snapshot {snap}: manifest.json is missing or malformed: {exc!r}") from exc
    if manifest.get("format_version") != SNAPSHOT_FORMAT_VERSION:
        raise SnapshotError(f"snapshot {snap}: format version {manifest.get('format_version')} is not supported; "
                            f"expected {SNAPSHOT_FORMAT_VERSION}")
    if manifest.get("schema_version") not in (SCHEMA_VERSION, *UPGRADABLE):
        raise SnapshotError(f"snapshot {snap}: trajectory schema version {manifest.get('schema_version')} is not "
                            f"supported; expected {SCHEMA_VERSION} (or {UPGRADABLE}, upgraded on read)")
    if snap.name != f"snap-{lsn:020d}" or set(files) != {"trajectories.arrow", "groups.arrow", "state.json"}:
        raise SnapshotError(f"snapshot {snap}: manifest names lsn {lsn} and files {sorted(files)}")
    try:
        data = {name: read_verified(snap, name, want) for name, want in files.items()}
    except (KeyError, TypeError, AttributeError) as exc:  # e.g. one flipped bit: "bytes" -> "bytds"
        raise SnapshotError(f"snapshot {snap}: manifest.json file entries are malformed: {exc!r}") from exc
    try:
        state = json.loads(data["state.json"].to_pybytes())
    except ValueError as exc:
        raise SnapshotError(f"snapshot {snap}: state.json is not JSON: {exc}") from exc
    meta = _read_arrow(snap, "groups.arrow", data["groups.arrow"], GROUPS_SCHEMA).to_pydict()
    old = manifest["schema_version"] != SCHEMA_VERSION  # written before an upgrade: read it and upgrade
    table = _read_arrow(snap, "trajectories.arrow", data["trajectories.arrow"], V3_SCHEMA if old else TRAJECTORY_SCHEMA)
    if old:
        table = upgrade(table, f"snapshot {snap}")
    if sum(meta["num_rows"]) != table.num_rows:
        raise SnapshotError(f"snapshot {snap}: groups.arrow counts {sum(meta['num_rows'])} rows; "
                            f"trajectories.arrow has {table.num_rows}")
    offsets = np.zeros(len(meta["num_rows"]), np.int64)
    np.cumsum(meta["num_rows"][:-1], out=offsets[1:])
    groups = [Group(key, gid, prompt, oldest, table, off, n, nb, st, ts, pr) for key, gid, prompt, oldest, off, n, nb,
              st, ts, pr in zip(meta["key"], meta["group_id"], meta["prompt_index"], meta["oldest_version"],
                                offsets.tolist(), meta["num_rows"], meta["nbytes"], meta["state"],
                                meta["times_sampled"], meta["priority"])]
    return SnapshotData(lsn, groups, state, float(manifest.get("created_at", 0.0)))
