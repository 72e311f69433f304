"""One driver per run directory: a second `gyre run` of a live run is refused with the holder's pid, and a
driver killed with SIGKILL leaves no stale lock."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.services.control.orchestration.controller import run
from gyre.services.control.recipe.schema import load_recipe
from gyre.services.control.outputs.run_lock import RunDirBusyError, hold_run_dir, lock_paths

REPO = Path(__file__).resolve().parents[3]


HOLD = """
import sys, time
from pathlib import Path
from gyre.services.control.outputs.run_lock import hold_run_dir
with hold_run_dir(Path(sys.argv[1])):
    print("ready", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """A process (importing only the lock module) holding ``tmp_path/runs/r``'s lock; yields (out_dir, process)."""
    out = tmp_path / "runs" / "r"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", "the holder process did not take the lock"
    yield out, proc
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_a_second_holder_is_refused_naming_the_pid_and_the_lock_file(holder):
    out, proc = holder
    with pytest.raises(RunDirBusyError) as err:
        with hold_run_dir(out):
            pass
    assert f"pid {proc.pid}" in str(err.value) and str(lock_paths(out)[0]) in str(err.value)


def test_a_killed_holder_leaves_no_stale_lock(holder):
    out, proc = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
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
