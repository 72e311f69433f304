"""Replay data written by trajectory schema version 3 (before the multi-turn columns) restores on version 4:
every group comes back, as the single-turn rows it was (mask all 1, one turn), and nothing is quarantined."""

import hashlib
import json

import pyarrow as pa
import structlog

from gyre.proto.trajectory import SCHEMA_VERSION, from_table, to_ipc
from gyre.proto.trajectory_upgrade import V3_SCHEMA
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.snapshot import list_snapshots
from tests.fakes import group_table
from tests.fault.test_replay_corruption import cfg, groups_of


def as_v3(table: pa.Table) -> pa.Table:
    return pa.Table.from_arrays([table.column(n) for n in V3_SCHEMA.names], schema=V3_SCHEMA)


def downgrade_snapshot(snap) -> None:
    """Rewrite a snapshot as version 3 wrote it: trajectories without the new columns, manifest version 3."""
    path = snap / "trajectories.arrow"
    table = as_v3(pa.ipc.open_file(pa.py_buffer(path.read_bytes())).read_all())
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    manifest = json.loads((snap / "manifest.json").read_text())
    data = path.read_bytes()
    manifest["files"]["trajectories.arrow"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (snap / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 3}))


def test_a_version_3_snapshot_and_wal_restore_every_group_as_single_turn_rows(tmp_path):
    buf = TrajectoryBuffer(cfg(tmp_path))
    expected = {}
    for i in range(6):
        table = group_table(i, response_len=5 + i)
        expected[i] = from_table(table)
        buf.insert(table, payload=to_ipc(as_v3(table)))  # the WAL logs version-3 bytes, as the old code did
        if i == 3:
            buf.snapshot()
    buf.close()
    downgrade_snapshot(list_snapshots(tmp_path / "snapshots")[0])
    with structlog.testing.capture_logs() as logs:
        back = TrajectoryBuffer(cfg(tmp_path))
    assert not [e for e in logs if "corrupt" in e["event"] or "quarantin" in e["event"]], logs
    assert groups_of(back) == list(range(6))
    assert back.durability.report.snapshot == str(list_snapshots(tmp_path / "snapshots")[0])
    _, table = back.sample(6, learner_version=0)
    assert table.schema.metadata[b"gyre.schema_version"] == str(SCHEMA_VERSION).encode()
    rows = sorted(from_table(table), key=lambda r: r.trajectory_id)
    assert rows == sorted((r for g in expected.values() for r in g), key=lambda r: r.trajectory_id)
    assert all(r.loss_mask == [1] * len(r.response_token_ids) and r.turn_starts == [0] for r in rows)
    back.close()
