"""``learner.jit_ops``: a ``lock`` file a killed process left in an op's build folder is removed before the load,
under an flock, instead of hanging every later learner in torch's ``FileBaton.wait``."""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path

from torch.utils.file_baton import FileBaton

from gyre.learner import jit_ops


class FakeBuilder:
    name = NAME = "fake_op"

    def __init__(self) -> None:
        self.loads = 0

    def load(self):
        self.loads += 1
        return "module"


def test_torch_waits_on_a_lock_file_nobody_holds(tmp_path):
    """Why the module exists: torch's baton has no owner, so a dead loader's file blocks every later one."""
    (tmp_path / "lock").touch()
    baton = FileBaton(str(tmp_path / "lock"), wait_seconds=0.01)
    assert not baton.try_acquire()
    waiter = threading.Thread(target=baton.wait, daemon=True)
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive(), "FileBaton.wait returned with the lock file still there"
    (tmp_path / "lock").unlink()
    waiter.join(5.0)
    assert not waiter.is_alive()


def test_a_stale_lock_is_removed_before_the_op_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "fake_op").mkdir()
    (tmp_path / "fake_op" / "lock").touch()
    builder = FakeBuilder()
    assert jit_ops.load_comm_op(builder) == "module" and builder.loads == 1
    assert not (tmp_path / "fake_op" / "lock").exists()
    assert (tmp_path / jit_ops.FLOCK_NAME).exists()


def test_without_a_stale_lock_the_op_just_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "fresh"))  # not created yet: made on the way
    builder = FakeBuilder()
    assert jit_ops.load_comm_op(builder) == "module" and builder.loads == 1
    assert jit_ops.build_dir("fake_op") == tmp_path / "fresh" / "fake_op"


def test_the_cpu_accelerator_has_the_comm_op_this_guards(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builder = jit_ops._comm_op_builder()
    assert builder is not None and jit_ops.build_dir(builder.name) == tmp_path / "deepspeed_shm_comm"


class PathRecordingBuilder(FakeBuilder):
    def load(self):
        self.ninja = shutil.which("ninja")
        return super().load()


def test_the_op_builds_with_the_interpreters_own_ninja_whatever_path_says(tmp_path, monkeypatch):
    """torch runs the first ``ninja`` on ``PATH``; ninja 1.11 and 1.13 hash a command differently in
    ``.ninja_log``, so processes finding different ones rebuilt the op for each other (25–50 s each time)."""
    other = tmp_path / "bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (other / "ninja").chmod(0o755)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("PATH", os.pathsep.join([str(other), os.environ["PATH"]]))
    own = Path(sys.executable).parent / "ninja"
    assert own.is_file(), "the lock's ninja package is not in the interpreter's bin folder"
    builder = PathRecordingBuilder()
    assert jit_ops.load_comm_op(builder) == "module"
    assert Path(builder.ninja) == own
    assert shutil.which("ninja") == str(other / "ninja")  # PATH restored
