"""``gyre sweep`` end to end: a 1 × 2 sweep of tiny-model lockstep runs (``lockstep_lag`` 0 and 2; real vLLM,
DeepSpeed, gRPC, a local Ray per run) is SIGKILLed as a process group while its second run
is mid-way (no driver may outlive it; other processes of the run that do — two were still alive 60 s after the
kill once — are stopped by the second start before it resumes the run), run again, and finishes with every
run complete exactly once and nothing it started left running; ``gyre compare --by lockstep_lag`` on
the sweep directory then writes the PNGs and the Markdown and CSV tables, the lag read from each run's recipe.

"Exactly once" is read from the runs' own records: each run's learner journal commits steps 1 to 3 once each
(nothing trained twice); the run finished before the kill was never started again (one cold-start ``resume``
event), the interrupted run resumed from its checkpoint (a second ``resume`` from a checkpoint, not from
scratch), and ``metrics.jsonl`` holds each step exactly once — also a step the interrupted run's learner finished
in the seconds between its driver's death and its own: the driver never wrote that row, the resumed run writes it
from the learner's own copy (``learner_rows.jsonl``, marked ``recovered``). Before that copy existed such rows were
lost (seen here: the killed run's learner committed steps 2 and 3 after the kill).

Each run is 3 learner steps (so that at the last step every lag up to 2 is reached), no evaluation, the tiny-test
recipe's smallest batch; 3 starts in all. The grid's expansion (several keys, zips, seeds) is the unit tests'
(``tests/unit/services/test_sweep_config.py``, ``test_sweep_runs.py``); this test keeps what needs real runs: the
kill, the resume, exactly once, no process left, and ``gyre compare`` on real metrics. The 2 × 2 × 2 grid it
replaced took 1080 s on the 2-core machine (9 starts, 99–145 s each while other tests ran beside it); the
1 × 3 grid (lags 0, 1, 2) after it 406 s in a fresh-clone ``make test``. Lags 0 and 2 keep both ends of the
staleness claim: lag 1 adds a run start and no check the unit tests lack.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS = 3
LAGS = (0, 2)
NAMES = [f"lag{lag}-s0" for lag in LAGS]
VICTIM = NAMES[-1]
"""The run in progress when the sweep is killed (the last)."""


def _sweep_file(tmp_path: Path, tiny_llama: Path) -> Path:
    path = tmp_path / f"sweep-{uuid.uuid4().hex[:8]}.yaml"
    path.write_text(yaml.safe_dump({
        "base": "deploy/recipes/tiny-test.yaml", "run_dir": str(tmp_path / "runs"),
        "set": {"model": str(tiny_llama), "ray.num_cpus": 2, "learner.num_steps": STEPS, "learner.save_interval": 1,
                "eval.before": False, "eval.after": False, "determinism": "lockstep",
                "learner.algorithm.is_weight": "mis_token", "replay.max_staleness": max(LAGS)},
        "grid": {"lockstep_lag": list(LAGS)}, "seeds": [0], "run_name": "lag{lockstep_lag}-s{seed}"}, sort_keys=False))
    return path


def _gyre(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gyre.services.cli", *args], cwd=REPO, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout_s)


def _sweep_processes(sweep: str) -> dict[int, str]:
    """Live processes the sweep started, directly or not (its ``GYRE_SWEEP`` marker in their environment: drivers,
    Ray's processes, the services' actors): pid → command line."""
    marker, out = f"GYRE_SWEEP={sweep}\0".encode(), {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes():
                out[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours
            continue
    return out


def _training_steps(out: Path) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "loss" in r]


def _wait_for_step(out: Path, step: int, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the sweep exited ({proc.returncode}) early:\n{log.read_text()[-4000:]}"
        if (out / "metrics.jsonl").is_file() and step in _training_steps(out):
            return
        time.sleep(0.2)
    pytest.fail(f"{out.name} reached no step {step} in {timeout_s} s:\n{log.read_text()[-4000:]}")


def _journal(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "learner_journal.jsonl").read_text().splitlines() if line.strip()]


def _check_run(out: Path, interrupted: bool) -> None:
    events = _journal(out)
    resumes = [e for e in events if e["event"] == "resume"]
    commits = [e["step"] for e in events if e["event"] == "commit"]
    assert sorted(commits) == list(range(1, STEPS + 1)), (out.name, commits)  # every step trained once
    assert json.loads((out / "summary.json").read_text())["final_version"] == STEPS
    steps = _training_steps(out)
    assert len(steps) == len(set(steps)), (out.name, steps)
    if not interrupted:
        assert [r["path"] for r in resumes] == [None], (out.name, resumes)  # started once, never again
        assert steps == list(range(1, STEPS + 1)), (out.name, steps)
        return
    assert len(resumes) == 2 and resumes[0]["path"] is None, resumes
    assert resumes[1]["step"] >= 1 and resumes[1]["path"].endswith(f"global_step_{resumes[1]['step']}"), resumes
    assert steps == list(range(1, STEPS + 1)), steps  # no row lost, also of steps finished after the kill


def test_a_killed_sweep_resumes_and_each_run_completes_exactly_once(tiny_llama, tmp_path):
    path = _sweep_file(tmp_path, tiny_llama)
    sweep, sweep_dir = path.stem, tmp_path / "runs" / path.stem
    log = tmp_path / "sweep-first.log"
    try:
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "gyre.services.cli", "sweep", str(path)], cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        _wait_for_step(sweep_dir / VICTIM, 1, proc, log, timeout_s=1200)
        os.killpg(proc.pid, signal.SIGKILL)  # the sweep's process group; its drivers die with it (PDEATHSIG)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while _sweep_processes(sweep) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _sweep_processes(sweep)  # the re-run must stop these before it resumes the run
        if left:
            warnings.warn(f"alive 60 s after the sweep was killed: {left}")
        assert not [c for c in left.values() if "gyre.services.cli run" in c], f"a driver outlived the sweep: {left}"

        status = _gyre("sweep", "status", str(path), timeout_s=300)
        still = set(left) & set(_sweep_processes(sweep))
        assert status.returncode == 0, status.stdout + status.stderr
        assert f"{len(NAMES) - 1} done, 1 partial" in status.stdout, status.stdout

        second = _gyre("sweep", str(path), timeout_s=1800)
        assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
        assert _sweep_processes(sweep) == {}, "the sweep's runs left processes behind"
    finally:
        for pid in _sweep_processes(sweep):  # only after a failure: what this test's sweeps started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if still:  # what outlived the kill was stopped by the second start, before it resumed the run
        assert f"[{len(NAMES) - 1}] {VICTIM}: killed " in second.stdout, (left, second.stdout)
    assert all(f"[{i}] {name}: done, skipped" in second.stdout for i, name in enumerate(NAMES[:-1])), second.stdout
    assert f"[{len(NAMES) - 1}] {VICTIM}: started (attempt 2" in second.stdout
    for name in NAMES:
        _check_run(sweep_dir / name, interrupted=name == VICTIM)
    record = {r["name"]: r for r in json.loads((sweep_dir / "sweep.json").read_text())["runs"]}
    assert [record[n]["state"] for n in NAMES] == ["done"] * len(NAMES)
    assert [a["exit_code"] for a in record[VICTIM]["attempts"]] == [None, 0]  # killed, then finished
    assert all([a["exit_code"] for a in record[n]["attempts"]] == [0] for n in NAMES if n != VICTIM)
    assert f"{len(NAMES)} done" in _gyre("sweep", "status", str(path), timeout_s=300).stdout

    cmp = _gyre("compare", str(sweep_dir), "--by", "lockstep_lag", "--threshold", "reward_mean=0.01",
                "--out", str(tmp_path / "compare"), timeout_s=300)
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    for stem in ("reward_mean", "staleness_mean", "is_ratio_mean", "ppo_clip_frac", "is_ess_frac", "approx_kl"):
        assert (tmp_path / "compare" / f"{stem}.png").stat().st_size > 0, stem
    md = (tmp_path / "compare" / "compare.md").read_text()
    assert all(f"| lockstep_lag={lag} | reward_mean | 1 |" in md for lag in LAGS), md
    rows = {(r["group"], r["metric"]): r for r in csv.DictReader((tmp_path / "compare" / "compare.csv").open())}
    # lockstep trains step s on prompts generated by version max(0, s - 1 - lag): at the last step the lag is
    # exactly the recipe's (STEPS - 1 >= lag)
    for lag in LAGS:
        row = rows[(f"lockstep_lag={lag}", "staleness_mean")]
        assert float(row["final_max"]) == float(row["final_min"]) == lag, row
