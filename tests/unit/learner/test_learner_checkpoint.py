"""learner.checkpoint: commit protocol, verification, corruption, resume selection, RNG (no DeepSpeed)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from gyre.learner.checkpoint import store as ckpt
from gyre.proto.trajectory import SCHEMA_VERSION


def save(root: Path, step: int, payload: bytes = b"weights", **meta) -> Path:
    """A checkpoint whose 'DeepSpeed' part is one file, committed with the real protocol."""
    tmp = ckpt.temp_path(root, step)
    (tmp / "deepspeed").mkdir(parents=True)
    (tmp / "deepspeed" / "model.pt").write_bytes(payload * 100)
    ckpt.save_rng(tmp)
    return ckpt.commit(tmp, ckpt.checkpoint_path(root, step),
                       ckpt.CheckpointMetadata(step=step, policy_version=step, **meta))


def test_commit_writes_layout_and_manifest_last(tmp_path):
    path = save(tmp_path, 3, pending_lease_ids=["l1"], fingerprint="fp")
    assert path == tmp_path / "global_step_3" and not list(tmp_path.glob("*.tmp-*"))
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"deepspeed/model.pt", "rng_rank0.safetensors", "rng_rank0.json",
                                      "metadata.json"}
    assert manifest["schema_version"] == SCHEMA_VERSION
    meta = ckpt.verify(path)
    assert (meta.step, meta.policy_version, meta.pending_lease_ids, meta.fingerprint) == (3, 3, ["l1"], "fp")


def test_find_latest_verified_picks_newest_and_ignores_temp_dirs(tmp_path):
    for step in (1, 2, 10):
        save(tmp_path, step)
    (tmp_path / "global_step_11.tmp-999").mkdir()
    assert ckpt.find_latest_verified(tmp_path) == tmp_path / "global_step_10"
    assert ckpt.find_latest_verified(tmp_path / "absent") is None


@pytest.mark.parametrize("damage, reason", [
    (lambda p: (p / "deepspeed" / "model.pt").write_bytes(b"w"), "deepspeed/model.pt has 1 bytes"),
    (lambda p: _flip_byte(p / "deepspeed" / "model.pt"), "deepspeed/model.pt sha256 does not match"),
    (lambda p: _flip_byte(p / "metadata.json"), "metadata.json sha256 does not match"),
    (lambda p: (p / "manifest.json").unlink(), "manifest.json is missing"),
    (lambda p: (p / "rng_rank0.json").unlink(), "rng_rank0.json is missing"),
    (lambda p: (p / "manifest.json").write_text("{trunc"), "manifest.json is unreadable"),
], ids=["truncated_file", "flipped_byte", "flipped_metadata_byte", "no_manifest", "missing_file", "bad_manifest"])
def test_a_damaged_checkpoint_is_named_and_skipped(tmp_path, damage, reason):
    save(tmp_path, 1)
    damage(save(tmp_path, 2))
    with capture_logs() as logs:
        assert ckpt.find_latest_verified(tmp_path) == tmp_path / "global_step_1"
    (warning,) = [e for e in logs if e["event"] == "checkpoint_skipped"]
    assert warning["log_level"] == "warning" and warning["path"] == str(tmp_path / "global_step_2")
    assert reason in warning["reason"] and str(tmp_path / "global_step_2") in warning["reason"]
    with pytest.raises(ckpt.CheckpointError, match=reason):
        ckpt.resolve_resume(tmp_path / "global_step_2", tmp_path)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_recommitting_a_step_replaces_the_old_dir(tmp_path):
    _flip_byte(save(tmp_path, 4, payload=b"a") / "deepspeed" / "model.pt")
    save(tmp_path, 4, payload=b"b")
    assert ckpt.find_latest_verified(tmp_path) == tmp_path / "global_step_4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_4"]


def test_prune_keeps_last_n(tmp_path):
    for step in range(1, 6):
        save(tmp_path, step)
    (tmp_path / "global_step_9.tmp-1").mkdir()  # a dead process's temp dir
    ckpt.prune(tmp_path, keep_last_n=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_4", "global_step_5"]
    with pytest.raises(ValueError, match=r"keep_last_n \(0\)"):
        ckpt.prune(tmp_path, 0)


def test_resolve_resume_modes(tmp_path):
    assert ckpt.resolve_resume("none", tmp_path) is None
    assert ckpt.resolve_resume("auto", tmp_path) is None
    save(tmp_path, 1)
    assert ckpt.resolve_resume("auto", tmp_path) == tmp_path / "global_step_1"
    assert ckpt.resolve_resume(str(tmp_path / "global_step_1"), tmp_path) == tmp_path / "global_step_1"
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint {tmp_path / 'nope'} does not exist"):
        ckpt.resolve_resume(tmp_path / "nope", tmp_path)


def test_schema_world_size_and_fingerprint_checks(tmp_path):
    path = save(tmp_path, 1, fingerprint="task=a")
    meta = ckpt.verify(path)
    ckpt.check_resumable(path, meta, "task=a", world_size=1)
    old = ckpt.CheckpointMetadata(step=1, policy_version=1, schema_version=SCHEMA_VERSION + 1)
    with pytest.raises(ckpt.CheckpointError,
                       match=f"schema version {SCHEMA_VERSION + 1}; this learner uses schema version {SCHEMA_VERSION}"):
        ckpt.check_resumable(path, old, "task=a", world_size=1, force=True)
    v3 = ckpt.CheckpointMetadata(step=1, policy_version=1, schema_version=3, fingerprint="task=a")  # before multi-turn
    ckpt.check_resumable(path, v3, "task=a", world_size=1)  # its replay data is upgraded on read: it resumes
    with pytest.raises(ckpt.CheckpointError, match="world size 1; this learner has world size 2"):
        ckpt.check_resumable(path, meta, "task=a", world_size=2)
    with pytest.raises(ckpt.CheckpointError, match="fingerprint: checkpoint 'task=a' != current 'task=b'"):
        ckpt.check_resumable(path, meta, "task=b", world_size=1)
    with capture_logs() as logs:
        ckpt.check_resumable(path, meta, "task=b", world_size=1, force=True)
    assert [e["event"] for e in logs] == ["resume_forced"]


def test_a_task_fingerprint_mismatch_lists_each_differing_key(tmp_path):
    saved = '{"task":{"heldout_size":128,"name":"basic_arithmetic","params":{"max_terms":2,"min_terms":2}}}'
    current = '{"task":{"heldout_size":64,"name":"basic_arithmetic","params":{"max_terms":3,"min_terms":2}}}'
    path = save(tmp_path, 1, fingerprint=saved)
    with pytest.raises(ckpt.CheckpointError) as refused:
        ckpt.check_resumable(path, ckpt.verify(path), current, world_size=1)
    assert ("(task.heldout_size: checkpoint 128 != current 64; task.params.max_terms: checkpoint 2 != current 3)"
            in str(refused.value)) and "--force-resume" in str(refused.value)


def test_rng_roundtrip_restores_torch_numpy_python(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    ckpt.save_rng(tmp_path)
    expected = (torch.rand(4), np.random.standard_normal(3), random.random(), random.gauss(0, 1))
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    ckpt.load_rng(tmp_path)
    got = (torch.rand(4), np.random.standard_normal(3), random.random(), random.gauss(0, 1))
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2:] == expected[2:]


def test_a_missing_checkpoint_path_is_named_as_missing(tmp_path):
    from gyre.learner.checkpoint.store import CheckpointError, verify

    with pytest.raises(CheckpointError, match="does not exist or is not a directory"):
        verify(tmp_path / "global_step_7")
