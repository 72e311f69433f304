"""One driver per run directory: a second `gyre run` of a live run is refused with the holder's pid, and a
driver killed with SIGKILL leaves no stale lock."""

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest

from services.control.controller import run
from services.control.recipe import load_recipe
from services.control.run_lock import RunDirBusyError, hold_run_dir, lock_paths

REPO = Path(__file__).resolve().parents[3]


def _hold(out_dir: str, ready) -> None:
    with hold_run_dir(Path(out_dir)):
        ready.set()
        time.sleep(600)


@pytest.fixture
def holder(tmp_path):
    """A spawned process holding ``tmp_path/runs/r``'s lock; yields (out_dir, process)."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    out = tmp_path / "runs" / "r"
    proc = ctx.Process(target=_hold, args=(str(out), ready), daemon=True)
    proc.start()
    assert ready.wait(60), "the holder process did not take the lock"
    yield out, proc
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)


def test_a_second_holder_is_refused_naming_the_pid_and_the_lock_file(holder):
    out, proc = holder
    with pytest.raises(RunDirBusyError) as err:
        with hold_run_dir(out):
            pass
    assert f"pid {proc.pid}" in str(err.value) and str(lock_paths(out)[0]) in str(err.value)


def test_a_killed_holder_leaves_no_stale_lock(holder):
    out, proc = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    with hold_run_dir(out) as lock_file:  # taken at once: the OS released the dead process's lock
        assert lock_file == lock_paths(out)[0]
    assert not lock_paths(out)[1].exists()  # the holder record goes with the lock
    with hold_run_dir(out):  # and it can be taken again after a clean release
        pass


def test_run_refuses_a_live_run_before_touching_it(holder, tiny_llama):
    out, proc = holder
    recipe = load_recipe(REPO / "deploy/recipes/tiny-test.yaml",
                         {"model": str(tiny_llama), "run_dir": str(out.parent), "name": out.name})
    with pytest.raises(RunDirBusyError, match=f"pid {proc.pid}"):
        run(recipe)
    assert not out.exists()  # no run directory, no Ray started, nothing written
