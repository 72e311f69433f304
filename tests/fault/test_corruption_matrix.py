"""Corruption matrix: every persistent artifact × {truncate, flip one bit, flip one byte} at several offsets.

Each case builds a small real artifact with the real writer next to a previous good one, damages it,
runs the real loader, and checks the one property that matters: either the damage is **detected** (an
error or a log event naming the file) and the previous good state is used, or it is **harmless**
(missed, and what loads is exactly the undamaged state). Silent use of damaged data fails the case.

The tally (``{"artifacts": {name: {...}}, "corruptions": N, "detected": N, "harmless": N, "crashed": N,
"lost": N}``; the ``xfail`` cases are the known bugs counted as crashed/lost) is written as JSON to ``$GYRE_CORRUPTION_REPORT`` when that is set (docs/durability/crash-testing.md's "corruptions detected").
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from gyre.learner.checkpoint import store as ckpt
from gyre.proto.tensor_chunks import ChunkAssembler, ChunkError, encode_tensors, iter_chunks
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.replay.snapshot import list_snapshots
from gyre.replay.wal_read import list_segments, read_segment
from gyre.rollout.spool import Spool
from tests.fakes import group_table

# ---- the damage -------------------------------------------------------------------------------------
TRUNCATE_AT = [0, 1, 0.5, -1]
"""Keep this many bytes (a fraction of the size; -1 = all but the last byte)."""
BIT_FLIP_AT = [0, 1, 0.25, 0.5, 0.75, -2, -1]
BYTE_FLIP_AT = [0, 0.5, -1]
DAMAGES = ([("truncate", a, 0) for a in TRUNCATE_AT] + [("flip", a, 0x01) for a in BIT_FLIP_AT]
           + [("flip", a, 0xFF) for a in BYTE_FLIP_AT])


def _offset(size: int, at: float) -> int:
    return size + at if at < 0 else (at if isinstance(at, int) else int(size * at))


def damage(data: bytes, kind: str, at: float, mask: int) -> tuple[bytes, int]:
    """``data`` truncated to ``at`` bytes, or with byte ``at`` XOR ``mask``; returns (bytes, offset)."""
    data = bytes(data)  # chunk data may be a memoryview of the publisher's buffer
    i = max(0, min(_offset(len(data), at), len(data) - 1))
    if kind == "truncate":
        return data[:i], i
    return data[:i] + bytes([data[i] ^ mask]) + data[i + 1:], i


def damage_file(path: Path, kind: str, at: float, mask: int) -> int:
    data, i = damage(path.read_bytes(), kind, at, mask)
    path.write_bytes(data)
    return i


def _id(d) -> str:
    kind, at, mask = d
    return f"{kind}{'' if kind == 'truncate' else f'{mask:#04x}'}@{at}"


KNOWN_CRASHES: dict = {}
"""Damage the loader does not survive today (an exception other than its named error): strict xfails."""


def known_crash(artifact: str, d) -> list:
    why = KNOWN_CRASHES.get((artifact, d))
    return [pytest.mark.xfail(strict=True, reason=f"BUG: {why}")] if why else []


OUTCOMES = ("detected", "harmless", "crashed", "lost")
"""detected: named error + previous good state; harmless: missed, what loads is the undamaged state;
crashed: the loader raised something other than its named error; lost: missed, and good data was dropped."""
TALLY: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(("corruptions",) + OUTCOMES, 0))


def record(artifact: str, outcome: str) -> None:
    TALLY[artifact]["corruptions"] += 1
    TALLY[artifact][outcome] += 1


def load_or_record_crash(artifact: str, load):
    """``load()``; an exception that is not the loader's named error is tallied as a crash and re-raised."""
    try:
        return load()
    except Exception:
        record(artifact, "crashed")
        raise


@pytest.fixture(scope="module", autouse=True)
def corruption_report():
    yield
    out = os.environ.get("GYRE_CORRUPTION_REPORT")
    if out:
        totals = {k: sum(t[k] for t in TALLY.values()) for k in ("corruptions",) + OUTCOMES}
        Path(out).write_text(json.dumps({"artifacts": dict(TALLY), **totals}, indent=2, sort_keys=True))


# ---- replay: WAL segment and snapshot files ---------------------------------------------------------
def replay_cfg(path: Path) -> ReplayConfig:
    return ReplayConfig(dir=str(path), wal={"segment_bytes": 4096}, snapshot={"interval_s": None, "wal_bytes": None})


def groups_of(buf) -> list[int]:
    return sorted(g.prompt_index for g in buf.state.store.groups.values())


def restored(path: Path):
    """``(groups, state_dict, report, log events)`` of a real restart on ``path``."""
    with capture_logs() as logs:
        buf = TrajectoryBuffer(replay_cfg(path))
    out = groups_of(buf), buf.state.state_dict(), buf.durability.report, logs
    buf.close()
    return out


@pytest.fixture(scope="module")
def wal_dir(tmp_path_factory):
    """Groups 0-2 in a snapshot, then one segment per record: groups 3, 4, 5 (records 3, 4, 5)."""
    path = tmp_path_factory.mktemp("wal") / "replay"
    buf = TrajectoryBuffer(replay_cfg(path))
    for i in range(6):
        buf.insert(group_table(i, response_len=200))
        if i == 2:
            buf.snapshot()
    buf.close()
    assert [int(p.name[:20]) for p in list_segments(path / "wal")][:3] == [3, 4, 5]
    return path, restored(path)


@pytest.mark.parametrize("d", DAMAGES, ids=_id)
def test_wal_segment(wal_dir, tmp_path, d):
    pristine, (good_groups, good_state, _, _) = wal_dir
    path = tmp_path / "replay"
    shutil.copytree(pristine, path)
    segment = list_segments(path / "wal")[1]  # holds record 4 (group 4); segments 3 and 5 around it
    record_end = read_segment(segment).ends[0]
    at = damage_file(segment, *d)
    groups, state, report, logs = load_or_record_crash("wal_segment", lambda: restored(path))
    named = [e for e in logs if e["event"] in ("replay_wal_corrupt", "replay_wal_torn_tail")
             and e["segment"] == str(segment)]
    if not named:
        assert (groups, state) == (good_groups, good_state), f"damage at byte {at} of {segment} went unnoticed"
        return record("wal_segment", "harmless")
    assert named[0]["event"] == "replay_wal_corrupt" and report.errors, "a middle segment is not a torn tail"
    assert groups == list(range(4 if at < record_end else 5)), "restore must keep exactly the good prefix"
    record("wal_segment", "detected")


@pytest.mark.parametrize("where", [0.25, 0.5, 0.75])
def test_wal_bit_flip_in_the_last_acknowledged_record(tmp_path, where):
    """Three groups in one cleanly closed segment; one bit of the last record flipped. A torn append
    leaves a short record; this one is whole, so it is corruption and must be reported as such."""
    buf = TrajectoryBuffer(ReplayConfig(dir=str(tmp_path), snapshot={"interval_s": None, "wal_bytes": None}))
    for i in range(3):
        buf.insert(group_table(i))
    buf.close()
    segment = list_segments(tmp_path / "wal")[-1]
    ends = read_segment(segment).ends
    assert len(ends) == 3
    damage_file(segment, "flip", ends[1] + int((ends[2] - ends[1]) * where), 0x01)
    groups, _, report, logs = load_or_record_crash("wal_segment_last_record", lambda: restored(tmp_path))
    assert groups == [0, 1]
    named = [e for e in logs if e["event"] == "replay_wal_corrupt" and e["segment"] == str(segment)]
    record("wal_segment_last_record", "detected" if named else "lost")
    assert named and report.errors, "an acknowledged record was dropped as a torn tail"


@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory):
    """Groups 0-5 in snapshot A, 0-11 in snapshot B, 0-17 with the WAL tail; plus what restore gives
    with B removed (the fallback every damaged-B case must reproduce exactly)."""
    path = tmp_path_factory.mktemp("snap") / "replay"
    buf = TrajectoryBuffer(replay_cfg(path))
    for i in range(18):
        buf.insert(group_table(i, response_len=50))
        if i in (5, 11):
            buf.snapshot()
    buf.close()
    for snap in list_snapshots(path / "snapshots"):  # same bytes at the same offsets on every run
        manifest = json.loads((snap / "manifest.json").read_bytes())
        manifest.update(created_at=1.7e9, config_sha256="0" * 64)
        (snap / "manifest.json").write_text(json.dumps(manifest, separators=(",", ":")))
    without_newest = path.parent / "without-newest"
    shutil.copytree(path, without_newest)
    shutil.rmtree(list_snapshots(without_newest / "snapshots")[0])
    return path, restored(path), restored(without_newest)


SNAPSHOT_FILES = ["trajectories.arrow", "groups.arrow", "state.json", "manifest.json"]


def _snapshot_cases():
    return [pytest.param(name, d, id=f"{name}-{_id(d)}", marks=known_crash(_snapshot_artifact(name), d))
            for name in SNAPSHOT_FILES for d in DAMAGES]


def _snapshot_artifact(name: str) -> str:
    return "replay_snapshot_" + name.replace(".", "_")


@pytest.mark.parametrize("name, d", _snapshot_cases())
def test_replay_snapshot_file(snapshot_dir, tmp_path, name, d):
    pristine, (good_groups, good_state, _, _), (fb_groups, fb_state, _, _) = snapshot_dir
    path = tmp_path / "replay"
    shutil.copytree(pristine, path)
    newest = list_snapshots(path / "snapshots")[0]
    at = damage_file(newest / name, *d)
    artifact = _snapshot_artifact(name)
    groups, state, report, logs = load_or_record_crash(artifact, lambda: restored(path))
    named = [e for e in logs if e["event"] == "replay_snapshot_corrupt" and e["snapshot"] == str(newest)]
    if not named:
        assert report.snapshot == str(newest) and (groups, state) == (good_groups, good_state), (
            f"damage at byte {at} of {newest / name} went unnoticed and changed what loads")
        return record(artifact, "harmless")
    assert name in named[0]["error"] or "manifest" in named[0]["error"], named[0]["error"]
    assert report.snapshot != str(newest) and not newest.exists(), "the bad snapshot is quarantined"
    assert (groups, state) == (fb_groups, fb_state) and groups == list(range(18))
    record(artifact, "detected")


def test_replay_snapshot_manifest_with_a_flipped_bit_in_a_key(snapshot_dir, tmp_path):
    """One bit of ``"bytes"`` flipped to ``"bytds"``: still JSON, so only a shape check catches it."""
    pristine, _, (fb_groups, fb_state, _, _) = snapshot_dir
    path = tmp_path / "replay"
    shutil.copytree(pristine, path)
    manifest = list_snapshots(path / "snapshots")[0] / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"bytes"', b'"bytds"', 1))
    groups, state, report, logs = load_or_record_crash("replay_snapshot_manifest_json", lambda: restored(path))
    assert any(e["event"] == "replay_snapshot_corrupt" for e in logs) and (groups, state) == (fb_groups, fb_state)
    record("replay_snapshot_manifest_json", "detected")


# ---- learner checkpoint ---------------------------------------------------------------------------
def write_checkpoint(root: Path, step: int) -> Path:
    """A committed checkpoint with a stand-in DeepSpeed file (no DeepSpeed needed)."""
    tmp = ckpt.temp_path(root, step)
    (tmp / "deepspeed").mkdir(parents=True)
    (tmp / "deepspeed" / "model.pt").write_bytes(bytes(range(256)) * 16 * step)
    return ckpt.commit(tmp, ckpt.checkpoint_path(root, step), ckpt.CheckpointMetadata(step=step, policy_version=step))


CHECKPOINT_FILES = {"checkpoint_data": "deepspeed/model.pt", "checkpoint_manifest": ckpt.MANIFEST,
                    "checkpoint_metadata": ckpt.METADATA}


def _checkpoint_cases():
    return [pytest.param(artifact, d, id=f"{artifact}-{_id(d)}", marks=known_crash(artifact, d))
            for artifact in CHECKPOINT_FILES for d in DAMAGES]


@pytest.mark.parametrize("artifact, d", list(_checkpoint_cases()))
def test_checkpoint_file(tmp_path, artifact, d):
    good, newest = write_checkpoint(tmp_path, 1), write_checkpoint(tmp_path, 2)
    want = ckpt.verify(newest)
    target = newest / CHECKPOINT_FILES[artifact]
    before = {p: p.read_bytes() for p in (newest / "deepspeed" / "model.pt", newest / ckpt.METADATA)}
    at = damage_file(target, *d)
    with capture_logs() as logs:
        chosen = load_or_record_crash(artifact, lambda: ckpt.find_latest_verified(tmp_path))
    skipped = [e for e in logs if e["event"] == "checkpoint_skipped" and e["path"] == str(newest)]
    if not skipped:
        assert chosen == newest and ckpt.verify(newest) == want, f"damage at byte {at} of {target} unnoticed"
        assert all(p.read_bytes() == b for p, b in before.items()), "resume would load damaged bytes"
        return record(artifact, "harmless")
    assert str(newest) in skipped[0]["reason"] and chosen == good and ckpt.verify(good).step == 1
    record(artifact, "detected")


# ---- rollout spool --------------------------------------------------------------------------------
@pytest.mark.parametrize("d", DAMAGES, ids=_id)
def test_spool_file(tmp_path, d):
    spool = Spool(tmp_path, max_bytes=10**9, max_groups=10)
    first, second = spool.put(group_table(0)), spool.put(group_table(1))
    at = damage_file(second.path, *d)
    with capture_logs() as logs:
        pending = load_or_record_crash("spool_file", Spool(tmp_path, max_bytes=10**9, max_groups=10).recover)
    named = [e for e in logs if e["event"] == "spool_quarantined" and e["file"] == str(second.path)]
    assert named, f"damage at byte {at} of {second.path} went unnoticed"
    assert "crc32" in named[0]["reason"] or "not a valid trajectory table" in named[0]["reason"]
    assert [e.path for e in pending] == [first.path] and spool.load(first).equals(group_table(0))
    assert (tmp_path / "quarantine" / second.path.name).exists()
    record("spool_file", "detected")


# ---- weight chunk in transit ----------------------------------------------------------------------
def _version(version: int) -> list:
    torch.manual_seed(version)
    named = [("a.weight", torch.randn(4, 8)), ("b.bias", torch.randn(8).to(torch.bfloat16))]
    return named, list(iter_chunks(version, encode_tensors(named), chunk_bytes=48))


@pytest.mark.parametrize("d", DAMAGES, ids=_id)
def test_weight_chunk_in_transit(d):
    (v1, chunks1), (v2, chunks2) = _version(1), _version(2)
    asm = ChunkAssembler()
    applied = [r for r in map(asm.feed, chunks1) if r is not None]  # the subscriber's current version
    assert applied[0][0] == 1
    data, at = damage(chunks2[1].data, *d)
    bad = chunks2[:1] + [dataclasses.replace(chunks2[1], data=data)] + chunks2[2:]
    with pytest.raises(ChunkError, match="'a.weight'") as err:
        for c in bad:
            assert asm.feed(c) is None, f"damage at byte {at} of chunk 1 produced a version"
    assert "a.weight" in str(err.value)
    assert all(torch.equal(t, w) for (_, t), (_, w) in zip(applied[0][1], v1))  # version 1 stays in use
    version, tensors = [r for r in map(asm.feed, chunks2) if r is not None][0]  # the resent stream applies
    assert version == 2 and all(torch.equal(t, w) for (_, t), (_, w) in zip(tensors, v2))
    record("weight_chunk", "detected")
