"""`gyre status / scale / checkpoint` reach a `gyre run` whose private Ray has token auth on (Ray 2.60 turns it
on for every private head, with the token in ``~/.ray/auth_token``) from a separate process with a clean
environment: no ``RAY_AUTH_*`` variables, only ``HOME`` and ``PATH``. Before the controller recorded its
auth settings in ``ray_connection.json`` these failed with ``InvalidAuthToken`` after ~20 s of retries.

The run gets a temporary ``HOME`` holding ``.ray/auth_token``; nothing is written to the real ``~/.ray``.
The ops commands do not need the services, so the run is interrupted (Ctrl-C) once they are done.
"""

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
NS = "gyre-ops-token-test"
RUN = "tiny-test"
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
    done = subprocess.run([sys.executable, "-m", "services.cli", *args, "--namespace", NS], cwd=REPO,
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
    sets = {"model": str(tiny_llama), "run_dir": str(runs), "ray.num_cpus": 2, "ray.namespace": NS,
            "learner.num_steps": 1000, "eval_before": False, "eval_after": False}
    with open(log, "wb") as out:
        driver = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "run", "deploy/recipes/tiny-test.yaml",
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

        code, out, _ = _gyre(home, "scale", "rollout", "2", "--run", RUN, "--run-dir", str(runs))
        assert code == 0 and f"run {RUN}: rollouts 1 → 2" in out, out
        code, out, _ = _gyre(home, "scale", "rollout", "2", "--run", RUN, "--run-dir", str(runs))
        assert code == 0 and f"run {RUN}: rollouts 2 → 2" in out, out  # the first request reached the run
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
    finally:
        _stop(driver)
    assert not (runs / RUN / CONNECTION_FILE).exists() and not (runs / RUN / "ray_address").exists(), (
        "the driver did not clean up after Ctrl-C; its log ends:\n" + log.read_text()[-6000:])
