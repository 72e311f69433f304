"""Kill the learner's checkpoint writer at each named phase; resume must always find a verified one.

The writer is a fresh ``python`` process (never a fork) running the real commit protocol with a
stand-in DeepSpeed file; ``GYRE_FAULT_POINT`` makes it SIGKILL itself at the phase.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gyre.learner.checkpoint import store as ckpt

REPO = Path(__file__).resolve().parents[2]

WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from gyre.learner.checkpoint import store as ckpt
    root, step = Path(sys.argv[1]), int(sys.argv[2])
    tmp = ckpt.temp_path(root, step)
    (tmp / "deepspeed").mkdir(parents=True)
    (tmp / "deepspeed" / "model.pt").write_bytes(b"w" * 4096)
    ckpt.save_rng(tmp)
    ckpt.commit(tmp, ckpt.checkpoint_path(root, step), ckpt.CheckpointMetadata(step=step, policy_version=step))
    ckpt.prune(root, keep_last_n=1)
""")


def write(root: Path, step: int, fault: str = "") -> int:
    env = {**os.environ, "GYRE_FAULT_POINT": fault, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", WRITER, str(root), str(step)], env=env, timeout=120).returncode


def test_unarmed_writer_commits(tmp_path):
    assert write(tmp_path, 1) == 0
    assert ckpt.find_latest_verified(tmp_path) == tmp_path / "global_step_1"


@pytest.mark.parametrize("phase", ["files_written", "before_manifest", "before_rename"])
def test_crash_before_the_rename_keeps_the_previous_checkpoint(tmp_path, phase):
    assert write(tmp_path, 1) == 0
    assert write(tmp_path, 2, f"learner.ckpt.{phase}") == -9  # SIGKILL (faults.fault_point)
    assert list(tmp_path.glob("global_step_2.tmp-*")), "the dead writer's temp dir is left behind"
    assert ckpt.find_latest_verified(tmp_path) == tmp_path / "global_step_1"
    assert write(tmp_path, 2) == 0  # the next save cleans the dead temp dir up and commits
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2"]


def test_crash_after_the_rename_has_a_complete_checkpoint(tmp_path):
    assert write(tmp_path, 1) == 0
    assert write(tmp_path, 2, "learner.ckpt.after_rename") == -9  # SIGKILL (faults.fault_point)
    assert ckpt.find_latest_verified(tmp_path) == tmp_path / "global_step_2"


def test_a_half_written_final_dir_is_skipped(tmp_path):
    """What a non-atomic writer would leave: files under the final name, no manifest."""
    assert write(tmp_path, 1) == 0
    (tmp_path / "global_step_2" / "deepspeed").mkdir(parents=True)
    (tmp_path / "global_step_2" / "deepspeed" / "model.pt").write_bytes(b"w" * 10)
    assert ckpt.find_latest_verified(tmp_path) == tmp_path / "global_step_1"
