"""Corrupt snapshots and WAL segments: the bad file is named in the log, the previous good state is used,
and a directory where nothing valid loads is an error, never a silent cold start."""

import hashlib
import json
import shutil

import pytest
import structlog

from gyre.proto.trajectory import SCHEMA_VERSION
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.replay.restore import RestoreError
from gyre.replay.snapshot import list_snapshots
from gyre.replay.wal_read import list_segments
from tests.fakes import group_table

NO_AUTO = {"interval_s": None, "wal_bytes": None}


def cfg(path, **kw):
    return ReplayConfig(dir=str(path), **{"snapshot": NO_AUTO, **kw})


def groups_of(buf):
    return sorted(g.prompt_index for g in buf.state.store.groups.values())


def flip(path, at: float, n: int = 16):
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i:i + n] = bytes(b ^ 0xFF for b in data[i:i + n])
    path.write_bytes(bytes(data))


def truncate(path, keep: float):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def restore_logged(config):
    with structlog.testing.capture_logs() as logs:
        buf = TrajectoryBuffer(config)
    return buf, logs


def consistent_but_wrong_state(snap):
    """A state.json that passes the manifest's hash check (the manifest is rewritten) but does not load."""
    (snap / "state.json").write_text('{"learner_version": 0}')
    manifest = json.loads((snap / "manifest.json").read_text())
    data = (snap / "state.json").read_bytes()
    manifest["files"]["state.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (snap / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def two_snapshots(tmp_path):
    """Groups 0-5 in snapshot A, 0-11 in snapshot B, 0-17 with the WAL tail."""
    buf = TrajectoryBuffer(cfg(tmp_path, wal={"segment_bytes": 4096}))
    for i in range(18):
        buf.insert(group_table(i, response_len=50))
        if i in (5, 11):
            buf.snapshot()
    buf.close()
    return tmp_path


@pytest.mark.parametrize("damage, message", [
    (lambda p: truncate(p / "trajectories.arrow", 0.5), "trajectories.arrow has"),
    (lambda p: flip(p / "trajectories.arrow", 0.5), "trajectories.arrow sha256"),
    (lambda p: flip(p / "groups.arrow", 0.6), "groups.arrow sha256"),
    (lambda p: (p / "manifest.json").write_text("{not json"), "manifest.json is missing or malformed"),
    (lambda p: (p / "state.json").unlink(), "state.json is missing"),
    (consistent_but_wrong_state, "state.json does not load"),
])
def test_bad_newest_snapshot_is_named_and_the_previous_one_is_used(two_snapshots, damage, message):
    newest = list_snapshots(two_snapshots / "snapshots")[0]
    damage(newest)
    buf, logs = restore_logged(cfg(two_snapshots))
    bad = [e for e in logs if e["event"] == "replay_snapshot_corrupt"]
    assert len(bad) == 1 and bad[0]["snapshot"] == str(newest) and message in bad[0]["error"]
    assert groups_of(buf) == list(range(18))  # older snapshot + WAL tail
    assert buf.durability.report.snapshot != str(newest) and not newest.exists()  # quarantined
    assert any((two_snapshots / "quarantine").iterdir())
    buf.close()


def test_schema_version_mismatch_in_a_snapshot_names_both_versions(two_snapshots):
    newest = list_snapshots(two_snapshots / "snapshots")[0]
    manifest = json.loads((newest / "manifest.json").read_text())
    (newest / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 99}))
    buf, logs = restore_logged(cfg(two_snapshots))
    err = next(e for e in logs if e["event"] == "replay_snapshot_corrupt")["error"]
    assert f"schema version 99 is not supported; expected {SCHEMA_VERSION}" in err
    assert groups_of(buf) == list(range(18))
    buf.close()


def test_all_snapshots_bad_and_wal_compacted_is_a_clear_error(two_snapshots):
    for snap in list_snapshots(two_snapshots / "snapshots"):
        flip(snap / "trajectories.arrow", 0.5)
    assert int(list_segments(two_snapshots / "wal")[0].name[:20]) > 0
    with pytest.raises(RestoreError, match=r"holds data but nothing valid loads: snapshot .*sha256.*start at LSN"):
        TrajectoryBuffer(cfg(two_snapshots))


def test_all_snapshots_bad_but_full_wal_restores_from_the_wal(tmp_path):
    buf = TrajectoryBuffer(cfg(tmp_path, snapshot={"interval_s": None, "wal_bytes": None, "keep": 5}))
    for i in range(6):
        buf.insert(group_table(i))
    buf.snapshot()  # covers segment 0 only partially: nothing is deleted
    buf.close()
    flip(list_snapshots(tmp_path / "snapshots")[0] / "groups.arrow", 0.5)
    buf, logs = restore_logged(cfg(tmp_path))
    assert {"replay_snapshot_corrupt", "replay_restore_from_wal_only"} <= {e["event"] for e in logs}
    assert groups_of(buf) == list(range(6))
    buf.close()


@pytest.fixture
def one_insert_per_segment(tmp_path):
    """Ten inserts (groups 0-9), each WAL record in its own segment (records 0-9)."""
    buf = TrajectoryBuffer(cfg(tmp_path, wal={"segment_bytes": 4096}))
    for i in range(10):
        buf.insert(group_table(i, response_len=5000))
    buf.close()
    segments = list_segments(tmp_path / "wal")
    assert [int(p.name[:20]) for p in segments[:10]] == list(range(10))
    return tmp_path, segments


@pytest.mark.parametrize("damage", [lambda p: flip(p, 0.6), lambda p: truncate(p, 0.7)])
def test_bad_middle_segment_keeps_the_good_prefix_and_names_the_file(one_insert_per_segment, damage):
    path, segments = one_insert_per_segment
    damage(segments[5])
    buf, logs = restore_logged(cfg(path, wal={"segment_bytes": 4096}))
    bad = [e for e in logs if e["event"] == "replay_wal_corrupt"]
    assert len(bad) == 1 and bad[0]["segment"] == str(segments[5]) and bad[0]["kept_up_to_record"] == 4
    assert groups_of(buf) == [0, 1, 2, 3, 4]
    assert len(list((path / "quarantine").iterdir())) >= 5  # the bad segment and every later one
    buf.insert(group_table(10))  # serving again, from record 5 on
    buf.close()
    again, logs = restore_logged(cfg(path))
    assert groups_of(again) == [0, 1, 2, 3, 4, 10]
    assert not [e for e in logs if e["event"] in ("replay_wal_corrupt", "replay_snapshot_corrupt")]
    again.close()


def test_torn_final_record_is_dropped_quietly(one_insert_per_segment):
    path, segments = one_insert_per_segment
    last = segments[-1]
    if last.stat().st_size < 1000:  # the clean close opened an empty newest segment: tear record 9 instead
        last.unlink()
        last = segments[-2]
        data = last.read_bytes()
        last.write_bytes(data[: len(data) - 100])
    buf, logs = restore_logged(cfg(path))
    events = {e["event"] for e in logs}
    assert "replay_wal_torn_tail" in events and "replay_wal_corrupt" not in events
    assert groups_of(buf) == list(range(9))
    buf.close()


def test_a_copy_of_a_good_directory_restores_identically(two_snapshots, tmp_path_factory):
    copy = tmp_path_factory.mktemp("copy") / "replay"
    shutil.copytree(two_snapshots, copy)
    a, b = TrajectoryBuffer(cfg(two_snapshots)), TrajectoryBuffer(cfg(copy))
    assert a.state.state_dict() == b.state.state_dict() and groups_of(a) == list(range(18))
    a.close()
    b.close()
