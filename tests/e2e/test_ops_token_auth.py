"""`gyre status / scale / checkpoint` reach a `gyre run` whose private Ray has token auth on (Ray 2.60 turns it
on for every private head, with the token in ``~/.ray/auth_token``) from a separate process with a clean
environment: no ``RAY_AUTH_*`` variables, only ``HOME`` and ``PATH``. Before the controller recorded its
auth settings in ``ray_connection.json`` these failed with ``InvalidAuthToken`` after ~20 s of retries.

The rollouts run the simulated engine (``tests.engines``): the ops commands and the swap are tested, not
vLLM, and three vLLM engines on two cores took most of this test's time.

The run gets a temporary ``HOME`` holding ``.ray/auth_token``; nothing is written to the real ``~/.ray``.

The same deployment (one is enough, and each costs minutes) checks a live reward swap (issue #25): the run's
rollout is scored by a reward function from a file the test writes; once it trains (and after the timed token
checks, whose bound a second vLLM engine starting beside them broke on two loaded cores), ``gyre reward swap`` puts
a second function file in force and ``gyre scale`` adds two rollouts; once every rollout delivered groups after
the swap the run is interrupted (Ctrl-C). Replay's WAL (every insert kept: ``replay.wal.keep_segments``) must show
the old and the new ``reward_fn_version`` on rollout-0's trajectories and only the new one on the rollouts added
after the swap; ``gyre status`` shows the new version on all three.
"""

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from gyre.replay.wal_read import list_segments, read_segment
from tests.engines import sim_engine

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
NS = "gyre-ops-token-test"
RUN = "tiny-test"
REWARD = """
def {name}(completions, **columns):
    return [{scale} * sum(ch in "0123456789 " for ch in c) / max(len(c), 1) for c in completions]
"""
CONNECTION_FILE = "ray_connection.json"
"""Spelled out, not imported: the file name is the contract (and the test runs against code without it)."""


def _driver_env(home: Path) -> dict:
    """The test's environment for ``gyre run``, with ``HOME`` moved and Ray's auth left to its defaults; the
    caches stay where they were (``XDG_CACHE_HOME``), so nothing is rebuilt under the new ``HOME``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_") and k != "RAY_ADDRESS"}
    env.update(HOME=str(home), XDG_CACHE_HOME=os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    return env


def _gyre(home: Path, *args: str) -> tuple[int, str, float]:
    """``gyre ARGS --namespace NS`` in a clean environment (``HOME`` and ``PATH`` only): (exit code, stdout +
    stderr with lines re-joined, seconds taken)."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gyre.services.cli", *args, "--namespace", NS], cwd=REPO,
                          env={"HOME": str(home), "PATH": os.environ["PATH"]}, capture_output=True, text=True,
                          timeout=120)
    return done.returncode, " ".join((done.stdout + "\n" + done.stderr).split()), time.monotonic() - t0


def _wait_for(path: Path, driver: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert driver.poll() is None, f"gyre run exited ({driver.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {path} after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def _stop(driver: subprocess.Popen) -> None:
    """Ctrl-C, as an operator would (the driver's ``finally`` removes the records and shuts Ray down). A driver
    still running 120 s later is asked for its threads' stacks (SIGUSR2, ``gyre run``'s faulthandler: they land in
    the run's log, which the failing assertion then shows) before it is killed."""
    if driver.poll() is None:
        driver.send_signal(signal.SIGINT)
        try:
            driver.wait(timeout=120)
        except subprocess.TimeoutExpired:
            driver.send_signal(signal.SIGUSR2)
            time.sleep(2)
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=30)


def test_ops_commands_reach_a_token_auth_run_from_a_clean_environment(tiny_llama, tmp_path):
    home, runs = tmp_path / "home", tmp_path / "runs"
    (home / ".ray").mkdir(parents=True)
    token = home / ".ray" / "auth_token"
    token.write_text(secrets.token_hex(32))
    log = tmp_path / "gyre-run.log"
    for version, scale in (("v1", 1.0), ("v2", 0.5)):
        (tmp_path / f"reward_{version}.py").write_text(REWARD.format(name=f"digits_{version}", scale=scale))
    sets = {"model": str(tiny_llama), "run_dir": str(runs), "ray.num_cpus": 2, "ray.namespace": NS,
            "learner.num_steps": 1000, "eval_before": False, "eval_after": False,
            "replay.wal.keep_segments": True, "task.reward": {"function": f"{tmp_path / 'reward_v1.py'}:digits_v1"},
            **sim_engine()}
    with open(log, "wb") as out:
        driver = subprocess.Popen(
            [sys.executable, "-m", "gyre.services.cli", "run", "deploy/recipes/tiny-test.yaml",
             *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]],
            cwd=REPO, env=_driver_env(home), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    try:
        _wait_for(runs / RUN / "ray_address", driver, log, timeout_s=180)
        gcs = (runs / RUN / "ray_address").read_text().strip()

        # the controller's state actor is created just after the address is written
        deadline = time.monotonic() + 60
        while True:
            code, out, took = _gyre(home, "status", RUN, "--run-dir", str(runs))
            if code == 0 or "none is running there" not in out or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert code == 0, f"gyre status failed after {took:.0f} s: {out}"
        assert out.startswith((f"run {RUN} (namespace {NS})", "status not published yet")), out

        record = json.loads((runs / RUN / CONNECTION_FILE).read_text())
        assert record == {"address": gcs, "auth_mode": "token", "token_path": str(token)}
        assert token.read_text() not in (runs / RUN / CONNECTION_FILE).read_text()

        code, out, _ = _gyre(home, "checkpoint", "--run", RUN, "--run-dir", str(runs))
        assert code == 0 and f"run {RUN}: emergency checkpoint requested" in out, out

        # --address and no record: the token in ~/.ray/auth_token is sent, as Ray does for address=auto
        code, out, _ = _gyre(home, "status", RUN, "--address", gcs, "--run-dir", str(tmp_path / "no-records"))
        assert code == 0, out

        # the recorded token file is the one used: a record pointing at another token is refused, in bounded time
        wrong = tmp_path / "wrong_token"
        wrong.write_text(secrets.token_hex(32))
        (tmp_path / "wrong" / RUN).mkdir(parents=True)
        (tmp_path / "wrong" / RUN / CONNECTION_FILE).write_text(json.dumps({**record, "token_path": str(wrong)}))
        code, out, took = _gyre(home, "status", RUN, "--run-dir", str(tmp_path / "wrong"))
        assert code == 2, out
        expected = (f"error: the Ray cluster at {gcs} refused this process's token (InvalidAuthToken; "
                    f"RAY_AUTH_MODE=token, token from RAY_AUTH_TOKEN_PATH={wrong}); "
                    f"expected the token run {RUN}'s Ray was started with")
        assert "".join(expected.split()) in "".join(out.split()), out  # rich wraps the long path anywhere
        assert took < 45, f"a refused token took {took:.0f} s to report"

        (tmp_path / "wrong" / RUN / CONNECTION_FILE).write_text("{")
        code, out, took = _gyre(home, "status", RUN, "--run-dir", str(tmp_path / "wrong"))
        expected = f"Ray connection record {tmp_path / 'wrong' / RUN / CONNECTION_FILE}: unreadable"
        assert code == 2 and "".join(expected.split()) in "".join(out.split()), out

        new_version = _swap_reward(home, runs, tmp_path)
        acked_at_swap = _acked(runs, "rollout-0")
        code, out, _ = _gyre(home, "scale", "rollout", "3", "--run", RUN, "--run-dir", str(runs))
        assert code == 0 and f"run {RUN}: rollouts 1 → 3" in out, out
        code, out, _ = _gyre(home, "scale", "rollout", "3", "--run", RUN, "--run-dir", str(runs))
        assert code == 0 and f"run {RUN}: rollouts 3 → 3" in out, out  # the first request reached the run
        # every rollout delivers groups started after the swap (groups_in_flight: 2 may have started before it)
        _wait_until(lambda: _acked(runs, "rollout-0") >= acked_at_swap + 3 and _acked(runs, "rollout-1") >= 1
                    and _acked(runs, "rollout-2") >= 1, "groups after the swap from every rollout", driver, log)
        code, out, _ = _gyre(home, "status", RUN, "--run-dir", str(runs))
        assert code == 0 and f"rewards basic_arithmetic={new_version} on rollout-0, rollout-1, rollout-2" in out, out
    finally:
        _stop(driver)
    seen = _reward_versions(runs / RUN / "replay" / "wal")
    [old_version] = set().union(*seen.values()) - {new_version}
    assert old_version.startswith("fn:reward_v1.py:digits_v1:") and new_version.startswith("fn:reward_v2.py:")
    assert seen == {"rollout-0": {old_version, new_version}, "rollout-1": {new_version},
                    "rollout-2": {new_version}}, seen
    assert not (runs / RUN / CONNECTION_FILE).exists() and not (runs / RUN / "ray_address").exists(), (
        "the driver did not clean up after Ctrl-C; its log ends:\n" + log.read_text()[-6000:])


def _swap_reward(home: Path, runs: Path, tmp_path: Path) -> str:
    """Once the run trains: a refused swap changes nothing, then ``reward_v2.py`` goes in force; its version."""
    def training() -> bool:
        code, out, _ = _gyre(home, "status", RUN, "--run-dir", str(runs), "--json")
        return code == 0 and (json.loads(out or "{}").get("learner_version") or 0) >= 1

    _wait_until(training, "training underway")
    code, out, _ = _gyre(home, "reward", "swap", "--run", RUN, "--run-dir", str(runs), "{name: humaneval}")
    assert code == 2 and "reward 'humaneval' does not fit task 'basic_arithmetic'" in out, out
    (tmp_path / "swap.yaml").write_text(f"function: {tmp_path / 'reward_v2.py'}:digits_v2\n")
    code, out, _ = _gyre(home, "reward", "swap", "--run", RUN, "--run-dir", str(runs), str(tmp_path / "swap.yaml"))
    assert code == 0 and "reward swapped on rollout-0;" in out, out
    events = [json.loads(line) for line in (runs / RUN / "reward_swaps.jsonl").read_text().splitlines()]
    swapped = {"basic_arithmetic": [{"function": f"{tmp_path / 'reward_v2.py'}:digits_v2"}]}
    assert [e["rewards"] for e in events] == [swapped]  # the absolute path, in the canonical form
    return events[0]["versions"]["basic_arithmetic"]


def _acked(runs: Path, rollout: str) -> int:
    """Groups ``rollout`` delivered so far (its journal's ``acked`` events)."""
    path = runs / RUN / "rollouts" / f"{rollout}.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return sum(len(json.loads(line).get("groups", [])) for line in lines if '"acked"' in line)


def _wait_until(pred, what: str, driver: subprocess.Popen | None = None, log: Path | None = None,
                timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert driver is None or driver.poll() is None, f"gyre run exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(1)


def _reward_versions(wal: Path) -> dict[str, set[str]]:
    """Rollout id → the ``reward_fn_version``s of every trajectory it inserted (replay's WAL, all segments kept)."""
    seen: dict[str, set[str]] = {}
    for segment in list_segments(wal):
        for record in read_segment(segment).records:
            if record.kind == "insert":
                table = pa.ipc.open_stream(record.payload).read_all()
                for rid, version in zip(table.column("rollout_id").to_pylist(),
                                        table.column("reward_fn_version").to_pylist()):
                    seen.setdefault(rid, set()).add(version)
    return seen
