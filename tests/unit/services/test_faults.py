"""The fault injector: specs are validated, a kill lands at exactly the n-th hit, errors are injectable."""

import errno
import os
import subprocess
import sys

import pytest

from gyre import faults

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_parse_spec_reads_counts_errnos_and_lists():
    armed = faults.parse_spec("replay.wal.before_fsync#3, rollout.apply_weights,learner.ckpt.mid_write:EIO")
    assert armed["replay.wal.before_fsync"] == faults.Armed("replay.wal.before_fsync", 3, None)
    assert armed["rollout.apply_weights"].nth == 1
    assert armed["learner.ckpt.mid_write"].errno == errno.EIO
    assert faults.parse_spec("") == {}


@pytest.mark.parametrize("spec, match", [
    ("replay.wal.fsync", r"fault point 'replay.wal.fsync' .* is not one of: .*replay.wal.before_fsync"),
    ("rollout.apply_weights#0", r"hit count '0' must be a positive integer"),
    ("rollout.apply_weights#x", r"hit count 'x' must be a positive integer"),
    ("replay.wal.before_write:ENOPE", r"'ENOPE' is not an errno name"),
])
def test_parse_spec_names_what_is_wrong(spec, match):
    with pytest.raises(ValueError, match=match):
        faults.parse_spec(spec)


def test_inject_error_raises_until_cleared():
    faults.inject_error("replay.wal.before_write", errno.ENOSPC)
    try:
        with pytest.raises(OSError, match="injected at fault point 'replay.wal.before_write'") as info:
            faults.fault_point("replay.wal.before_write")
        assert info.value.errno == errno.ENOSPC
        faults.fault_point("replay.wal.before_fsync")  # another point: nothing
    finally:
        faults.clear_errors()
    faults.fault_point("replay.wal.before_write")
    with pytest.raises(ValueError, match="not one of"):
        faults.inject_error("no.such.point")


@pytest.mark.parametrize("spec, survived", [("rollout.apply_weights#3", 2), ("rollout.spool.flush", 5),
                                            ("rollout.apply_weights", 0)])
def test_the_process_is_sigkilled_at_the_nth_hit(spec, survived):
    code = ("import faults\n"
            "for i in range(5):\n"
            "    faults.fault_point('rollout.apply_weights')\n"
            "    print(i, flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, faults.ENV: spec, "PYTHONPATH": REPO},
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == [str(i) for i in range(survived)]
    assert proc.returncode == (0 if survived == 5 else -9)


def test_an_errno_spec_raises_from_the_nth_hit_on(monkeypatch):
    monkeypatch.setenv(faults.ENV, "rollout.spool.flush#2:EIO")
    faults.fault_point("rollout.spool.flush")  # hit 1 (the count is per process)
    for _ in range(2):
        with pytest.raises(OSError) as info:
            faults.fault_point("rollout.spool.flush")
        assert info.value.errno == errno.EIO


def test_a_fired_point_is_logged_and_fsynced_before_the_kill(tmp_path):
    log = tmp_path / "fired.jsonl"
    code = ("import faults\n"
            "for i in range(5):\n"
            "    faults.fault_point('rollout.apply_weights')\n")
    env = {**os.environ, **faults.armed_env("rollout.apply_weights#3", log, "rollout-2", 1), "PYTHONPATH": REPO}
    procs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60) for _ in range(2)]
    assert [p.returncode for p in procs] == [-9, -9]
    rows = faults.read_fire_log(log)  # appended by both processes, one line each
    assert [(r["point"], r["service"], r["incarnation"], r["hit"], r["action"]) for r in rows] == [
        ("rollout.apply_weights", "rollout-2", 1, 3, "SIGKILL")] * 2
    assert len({r["pid"] for r in rows}) == 2


def test_unfired_and_unlogged_points_leave_no_line(tmp_path, monkeypatch):
    log = tmp_path / "fired.jsonl"
    monkeypatch.setattr(faults, "_hits", {})  # hit counts are per process: other tests' hits do not count
    for key, value in faults.armed_env("rollout.spool.flush#3:EIO", log, "rollout-0", 0).items():
        monkeypatch.setenv(key, value)
    faults.fault_point("rollout.spool.flush")
    faults.fault_point("rollout.apply_weights")  # not armed
    assert faults.read_fire_log(log) == []
    faults.fault_point("rollout.spool.flush")
    for _ in range(2):  # an errno point fires from its 3rd hit on; the log records the first fire only
        with pytest.raises(OSError):
            faults.fault_point("rollout.spool.flush")
    [row] = faults.read_fire_log(log)
    assert (row["point"], row["hit"], row["action"], row["pid"]) == ("rollout.spool.flush", 3, "EIO", os.getpid())
    assert faults.armed_env("", log, "replay", 0) == {}


def test_a_torn_fire_log_is_named(tmp_path):
    log = tmp_path / "fired.jsonl"
    log.write_text('{"point": "x"}\n{"point": ')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        faults.read_fire_log(log)
