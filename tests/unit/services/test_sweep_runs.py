"""``gyre sweep``'s resume logic on synthetic run directories: a run's state comes from its own files (as
``gyre run --resume auto`` decides), done runs are skipped, the others launched once per sweep invocation, a
crashing run fails alone, a stopped sweep stops its runs. The runs are test doubles: a small Python command in
place of ``gyre run`` that writes what a run leaves behind."""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
from rich.console import Console

from gyre.services.cli import sweep
from gyre.services.cli.sweep import Plan, run_sweep
from gyre.services.cli.sweep_config import SweepConfig, expand_cells
from gyre.services.cli.sweep_procs import RUN_MARKER, kill_leftovers, marked_processes
from gyre.services.cli.sweep_state import SweepRecord, finished_version, run_state
from gyre.services.control.orchestration.controller import prepare_run_dir

STEPS = 2


def _metrics(out: Path, steps: list[int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, "eval": "before", "heldout_accuracy": 0.1}] + [{"step": s, "loss": 0.5} for s in steps]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "lo')


def test_a_run_state_comes_from_its_own_files(tmp_path):
    out = tmp_path / "r"
    assert run_state(out, STEPS).text() == "not started"
    assert run_state(out, STEPS, last_exit=2).text() == "failed (exit 2) at step 0/2"  # refused before a dir existed
    _metrics(out, [1])  # and a line cut short by a kill
    assert run_state(out, STEPS).text() == "partial step 1/2"
    assert run_state(out, STEPS, last_exit=0).state == "partial"  # exit 0 but not finished: not done
    assert run_state(out, STEPS, last_exit=-9).text() == "failed (exit -9) at step 1/2"
    (out / "summary.json").write_text(json.dumps({"final_version": 1}))
    assert run_state(out, STEPS).text() == "partial step 1/2"  # a summary short of num_steps (more steps asked)
    (out / "summary.json").write_text(json.dumps({"final_version": 2}))
    assert run_state(out, STEPS).text() == "done" and run_state(out, STEPS, last_exit=1).state == "done"
    assert run_state(out, 3).state == "partial"


def test_a_live_driver_shows_as_running_and_a_killed_one_does_not(tmp_path):
    out = tmp_path / "r"
    _metrics(out, [1])
    record = tmp_path / ".r.driver.json"
    record.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": 0}))
    assert run_state(out, STEPS).text() == f"running step 1/2 (pid {os.getpid()})"
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    record.write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "started": 0}))
    assert run_state(out, STEPS).state == "partial"


@pytest.mark.parametrize("summary", [None, {"final_version": 1}, {"final_version": 2}, {"final_version": 5},
                                     {"run": "r"}])
def test_done_agrees_with_what_gyre_run_resume_auto_calls_finished(tmp_path, summary):
    out = tmp_path / "r"
    out.mkdir()
    if summary is not None:
        (out / "summary.json").write_text(json.dumps(summary))
    recipe = types.SimpleNamespace(out_dir=out, name="r", learner=types.SimpleNamespace(resume="auto", num_steps=STEPS))
    finished = prepare_run_dir(recipe, Console(file=io.StringIO()))
    assert (finished is not None) == (finished_version(out, STEPS) is not None)


FAKE_RUN = """
import json, sys, time
from pathlib import Path
name, out, launches = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
with launches.open("a") as f:
    f.write(name + "\\n")
print("fake run", name)
if name.startswith("crash"):
    sys.exit(3)
if name.startswith("orphan"):  # a process that outlives this "driver", as a killed Ray's workers can
    import subprocess
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    (launches.parent / "orphan.pid").write_text(str(child.pid))
if name.startswith("slow") and launches.read_text().split().count(name) == 1:
    time.sleep(60)  # the first launch: until stopped
out.mkdir(parents=True, exist_ok=True)
(out / "summary.json").write_text(json.dumps({"final_version": %d}))
""" % STEPS


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
    """``run_command`` replaced by ``FAKE_RUN``; returns the file each launch appends its run name to."""
    launches = tmp_path / "launches.txt"
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)

    def command(plan, cell, submission_id=None):
        return [sys.executable, str(script), cell.name, str(plan.out_dir(cell)), str(launches)]

    monkeypatch.setattr(sweep, "run_command", command)
    monkeypatch.setattr(sweep, "POLL_S", 0.05)
    return launches


def _plan(tmp_path, names: list[str], parallel: int = 1) -> Plan:
    config = SweepConfig(base="b.yaml", name="t", zip={"x": names}, run_name="{x}", parallel=parallel)
    cells = expand_cells(config, {})
    return Plan(config, tmp_path / "t.yaml", tmp_path / "b.yaml", tmp_path / "runs" / "t", cells,
                {c.name: STEPS for c in cells})


def _launched(launches: Path) -> list[str]:
    return launches.read_text().split() if launches.exists() else []


def test_done_runs_are_skipped_the_others_launched_and_a_crash_fails_alone(tmp_path, fake_runs):
    plan = _plan(tmp_path, ["done", "partial", "crash", "fresh"])
    (plan.sweep_dir / "done").mkdir(parents=True)
    (plan.sweep_dir / "done" / "summary.json").write_text(json.dumps({"final_version": STEPS}))
    _metrics(plan.sweep_dir / "partial", [1])
    console = Console(file=io.StringIO(), width=200)
    assert run_sweep(plan, console) == 1  # one run is not done
    assert _launched(fake_runs) == ["partial", "crash", "fresh"]
    printed = console.file.getvalue()
    assert "[0] done: done, skipped" in printed and "[2] crash: exit 3, failed (exit 3) at step 0/2" in printed
    assert "[3] fresh: exit 0, done" in printed  # the sweep went on after the crash
    assert "fake run crash" in (plan.sweep_dir / "logs" / "crash.log").read_text()
    record = json.loads((plan.sweep_dir / "sweep.json").read_text())
    runs = {r["name"]: r for r in record["runs"]}
    assert [r["name"] for r in record["runs"]] == ["done", "partial", "crash", "fresh"]
    assert {n: r["state"] for n, r in runs.items()} == {"done": "done", "partial": "done", "crash": "failed",
                                                       "fresh": "done"}
    assert runs["done"]["attempts"] == [] and [a["exit_code"] for a in runs["crash"]["attempts"]] == [3]
    assert runs["partial"]["overrides"] == {"x": "partial"} and runs["partial"]["dir"] == str(plan.sweep_dir / "partial")

    # re-run: only the run that is not done is launched again; its attempts accumulate
    assert run_sweep(plan, Console(file=io.StringIO(), width=200)) == 1
    assert _launched(fake_runs) == ["partial", "crash", "fresh", "crash"]
    record = json.loads((plan.sweep_dir / "sweep.json").read_text())
    assert [len(r["attempts"]) for r in record["runs"]] == [0, 1, 2, 1]


def test_done_is_read_from_the_run_not_from_sweep_json(tmp_path, fake_runs):
    plan = _plan(tmp_path, ["a", "b"])
    assert run_sweep(plan, Console(file=io.StringIO())) == 0 and _launched(fake_runs) == ["a", "b"]
    (plan.sweep_dir / "b" / "summary.json").unlink()  # sweep.json still says done; the run's files do not
    assert json.loads((plan.sweep_dir / "sweep.json").read_text())["runs"][1]["state"] == "done"
    assert run_sweep(plan, Console(file=io.StringIO())) == 0 and _launched(fake_runs) == ["a", "b", "b"]


def test_parallel_runs_all_finish(tmp_path, fake_runs):
    plan = _plan(tmp_path, ["a", "b", "c"], parallel=2)
    assert run_sweep(plan, Console(file=io.StringIO())) == 0
    assert sorted(_launched(fake_runs)) == ["a", "b", "c"]


def test_sigterm_stops_the_running_driver_and_the_next_start_resumes_it(tmp_path, fake_runs):
    plan = _plan(tmp_path, ["slow", "never"])
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    console = Console(file=io.StringIO(), width=200)
    try:
        assert run_sweep(plan, console) == 130
    finally:
        timer.cancel()
    assert "SIGTERM: stopping 1 run(s)" in console.file.getvalue() and _launched(fake_runs) == ["slow"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the sweep's handler is gone again
    runs = {r["name"]: r for r in SweepRecord.read(plan.sweep_dir)["runs"]}
    (attempt,) = runs["slow"]["attempts"]
    assert attempt["stopped"] and attempt["exit_code"] not in (None, 0)  # SIGINT'd (KeyboardInterrupt)
    # stopped, not failed: both are simply not done, and the next start launches both
    assert runs["slow"]["status"] == runs["never"]["status"] == "not started"
    assert run_sweep(plan, Console(file=io.StringIO())) == 0
    assert _launched(fake_runs) == ["slow", "slow", "never"]


def test_processes_a_run_leaves_behind_are_killed(tmp_path, fake_runs):
    plan = _plan(tmp_path, ["orphan"])
    console = Console(file=io.StringIO(), width=200)
    assert run_sweep(plan, console) == 0
    pid = int((tmp_path / "orphan.pid").read_text())
    assert f"[0] orphan: killed 1 process(es) left by its driver (pids {pid})" in console.file.getvalue()
    assert marked_processes(plan.out_dir(plan.cells[0])) == []
    stat = Path(f"/proc/{pid}/stat")  # gone, or a zombie until init reaps it
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_only_processes_with_the_run_marker_are_found_and_killed(tmp_path):
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    mine = subprocess.Popen(sleep, env={**os.environ, RUN_MARKER: str(tmp_path / "r")})
    other = subprocess.Popen(sleep, env={**os.environ, RUN_MARKER: str(tmp_path / "r2")})
    plain = subprocess.Popen(sleep)
    try:
        assert marked_processes(tmp_path / "r") == [mine.pid]
        assert kill_leftovers(tmp_path / "r") == [mine.pid]
        assert mine.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None and plain.poll() is None
    finally:
        for proc in (mine, other, plain):
            proc.kill()
            proc.wait()
