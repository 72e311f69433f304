"""Record once, train many (``replay.recorded``): the recorded order, the copy a learner trains from, and the
recordings that are refused (missing, incomplete, corrupt)."""

from __future__ import annotations

import pytest

from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.replay.recorded import (RECORDING_MANIFEST, RecordingError, read_manifest, read_recording, recorded_replay_config,
                             sha256_files, write_replay_dir)
from gyre.replay.snapshot import list_snapshots
from gyre.replay.wal_read import list_segments
from tests.fakes import group_table

NO_AUTO = {"interval_s": None, "wal_bytes": None}


def recorded_config(path, **kw) -> ReplayConfig:
    return ReplayConfig(dir=str(path), seed=0, max_staleness=1, snapshot=kw.pop("snapshot", NO_AUTO), **kw)


def record(path) -> ReplayConfig:
    """A recorded run's replay: leases acked out of order, one released and taken again, one never acked, groups
    dropped as too stale (at the learner's version 2 with max_staleness 1). Its learner consumed prompts 0, 3, 4."""
    cfg = recorded_config(path)
    buf = TrajectoryBuffer(cfg)
    buf.insert(group_table(0))
    buf.insert(group_table(1))
    a, _ = buf.sample(1, learner_version=0, consumer="learner")  # prompt 0
    assert buf.sample(1, learner_version=2, timeout_s=0, consumer="learner") is None  # prompt 1 dropped as stale
    buf.insert(group_table(2, version=0))  # too stale at insert: never stored, gets no key
    buf.insert(group_table(3, version=2))
    buf.insert(group_table(4, version=2))
    b, _ = buf.sample(1, learner_version=2, consumer="learner")  # prompt 3
    c, _ = buf.sample(1, learner_version=2, consumer="learner")  # prompt 4 ...
    buf.release([c])  # ... returned (a learner crash) ...
    d, _ = buf.sample(1, learner_version=2, consumer="learner")  # ... and taken again
    buf.ack([d])
    buf.ack([a, b])
    buf.insert(group_table(5, version=2))
    buf.sample(1, learner_version=2, consumer="learner")  # prompt 5: leased, never acked
    buf.insert(group_table(6, version=2))  # never leased
    buf.close()
    return cfg


def test_the_recorded_order_is_the_acked_leases_in_lease_order(tmp_path):
    cfg = record(tmp_path / "rec")
    rec = read_recording(cfg)
    assert rec.group_ids == ["0-0", "3-0", "4-0"]
    assert rec.trajectory_ids == [f"{p}-{s}-0" for p in (0, 3, 4) for s in range(4)]
    for table, (prompt, version) in zip(rec.groups, [(0, 0), (3, 2), (4, 2)]):
        assert table.to_pylist() == group_table(prompt, version=version).to_pylist()  # the recorded rows, as sent
    # the recorded run's own replay config decides which groups got keys: read with another max_staleness,
    # the too-stale prompt 2 would have been stored and every later lease would name other groups
    wrong = read_recording(cfg.model_copy(update={"max_staleness": 2}))
    assert wrong.group_ids != rec.group_ids


def test_a_copy_hands_out_the_recording_in_order_whatever_the_learner_version(tmp_path):
    cfg = record(tmp_path / "rec")
    before = sha256_files(tmp_path / "rec")
    rec = read_recording(cfg)
    run_cfg = ReplayConfig(max_staleness=1, source={"recorded": str(tmp_path / "rec")},
                           snapshot=NO_AUTO)  # a learner's run with its own (tight) staleness setting
    derived = recorded_replay_config(run_cfg, len(rec.groups))
    consumed = []
    for name, versions in (("one", [5, 50, 500]), ("two", [0, 1, 2])):
        dest = write_replay_dir(rec, derived, tmp_path / name / "replay", {"source_run": str(tmp_path / "rec")})
        manifest = read_manifest(dest)
        assert manifest["groups"] == rec.group_ids and manifest["recording_files"] == before
        assert manifest["source_run"] == str(tmp_path / "rec") and manifest["trajectories"] == 12
        buf = TrajectoryBuffer(derived.model_copy(update={"dir": str(dest)}))  # restores the copy
        ids = []
        for version in versions:  # different learner versions, far past the recorded ones
            lease, table = buf.sample(1, learner_version=version, consumer="learner")
            ids += table.column("trajectory_id").to_pylist()
            buf.ack([lease])
        assert buf.sample(1, learner_version=600, timeout_s=0, consumer="learner") is None  # used up
        buf.close()
        consumed.append(ids)
    assert consumed[0] == consumed[1] == rec.trajectory_ids
    assert sha256_files(tmp_path / "rec") == before  # the recording was only read


def test_write_replay_dir_refuses_a_destination_that_holds_something(tmp_path):
    rec = read_recording(record(tmp_path / "rec"))
    dest = tmp_path / "run" / "replay"
    dest.mkdir(parents=True)
    (dest / "wal").mkdir()
    derived = recorded_replay_config(ReplayConfig(source={"recorded": str(tmp_path / "rec")}), 3)
    with pytest.raises(RecordingError, match=f"{dest} exists and is not empty"):
        write_replay_dir(rec, derived, dest, {})
    assert not (dest / RECORDING_MANIFEST).exists()


def test_missing_and_empty_recordings_are_refused_naming_the_path(tmp_path):
    with pytest.raises(RecordingError, match=f"replay directory {tmp_path / 'nope'} does not exist"):
        read_recording(recorded_config(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecordingError, match=f"{tmp_path / 'empty'} holds no WAL segment"):
        read_recording(recorded_config(tmp_path / "empty"))
    buf = TrajectoryBuffer(recorded_config(tmp_path / "unconsumed"))
    buf.insert(group_table(0))
    buf.sample(1, learner_version=0)  # leased, never acked
    buf.close()
    with pytest.raises(RecordingError, match="acknowledged no lease"):
        read_recording(recorded_config(tmp_path / "unconsumed"))


def _history_with_snapshots(cfg: ReplayConfig) -> None:
    buf = TrajectoryBuffer(cfg)
    for round_ in range(3):
        for i in range(6):
            buf.insert(group_table(round_ * 10 + i))
        lease, _ = buf.sample(2, learner_version=0)
        buf.ack([lease])
        buf.snapshot()
    buf.close()


def test_a_recording_whose_snapshots_deleted_wal_segments_is_refused_unless_it_kept_them(tmp_path):
    compacted = recorded_config(tmp_path / "compacted", wal={"segment_bytes": 4096})
    _history_with_snapshots(compacted)
    first = int(list_segments(tmp_path / "compacted" / "wal")[0].name[:20])
    assert first > 0
    with pytest.raises(RecordingError, match=f"WAL starts at LSN {first}.*replay.wal.keep_segments: true"):
        read_recording(compacted)
    kept = recorded_config(tmp_path / "kept", wal={"segment_bytes": 4096, "keep_segments": True})
    _history_with_snapshots(kept)
    assert len(list_snapshots(tmp_path / "kept" / "snapshots")) == 2
    assert int(list_segments(tmp_path / "kept" / "wal")[0].name[:20]) == 0
    assert read_recording(kept).group_ids == [f"{p}-0" for p in range(6)]  # FIFO: the oldest pooled first


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_recordings_are_refused_and_a_torn_tail_is_not_read(tmp_path):
    cfg = record(tmp_path / "rec")
    segment = list_segments(tmp_path / "rec" / "wal")[0]
    size = segment.stat().st_size
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "wal").mkdir()
    (torn / "wal" / segment.name).write_bytes(segment.read_bytes()[: size - 40])  # a crash mid-append
    got = read_recording(cfg.model_copy(update={"dir": str(torn)}))
    assert got.group_ids == ["0-0", "3-0", "4-0"] and got.torn_tail_bytes > 0

    _flip(segment, size // 3)  # a record in the middle: acknowledged data behind it
    with pytest.raises(RecordingError, match=f"corrupt recording: WAL segment {segment}"):
        read_recording(cfg)

    snapped = recorded_config(tmp_path / "snapped", wal={"keep_segments": True})
    _history_with_snapshots(snapped)
    trajectories = list_snapshots(tmp_path / "snapped" / "snapshots")[0] / "trajectories.arrow"
    _flip(trajectories, trajectories.stat().st_size // 2)
    with pytest.raises(RecordingError, match="corrupt recording: snapshot .*trajectories.arrow"):
        read_recording(snapped)
