"""`gyre status / scale / restart / checkpoint` from another process reach a run's controller state actor
on a real local Ray, through the address the controller recorded in ``{run_dir}/{run}/ray_address``.
(No services: the supervisor's side is covered by the partial-restart test.)"""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from gyre.services.control.orchestration.controller import init_ray
from gyre.services.control.commands.ops import create_state

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
NS = "gyre-ops-cli-test"


def _status() -> dict:
    return {"services": [
        {"name": "replay", "role": "replay", "pid": 11, "node": "127.0.0.1", "address": "127.0.0.1:5000",
         "version": None, "restarts": 0, "failures": 0},
        {"name": "learner", "role": "learner", "pid": 12, "node": "127.0.0.1", "address": "127.0.0.1:5001",
         "version": 3, "restarts": 1, "failures": 0},
        {"name": "rollout-0", "role": "rollout", "pid": 13, "node": "127.0.0.1", "address": None,
         "version": 3, "restarts": 0, "failures": 0}],
        "learner_version": 3, "rollout_versions": [3], "lag": 0, "rollout_tokens_per_s": 50.0,
        "learner_tokens_per_s": 20.0, "replay_groups": 2, "checkpoint_age_s": 4.0,
        "last_checkpoint": "/x/global_step_3", "learner_resumed_from": "/x/global_step_2",
        "restarts": {"replay": 0, "learner": 1, "rollout-0": 0}, "updated_at": time.time()}


def _gyre(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gyre.services.cli", *args, "--namespace", NS], cwd=REPO,
                          capture_output=True, text=True, timeout=180)


def test_ops_commands_reach_a_running_run(tmp_path):
    init_ray("local", num_cpus=1, namespace=NS, include_dashboard=False, log_to_driver=False)
    try:
        state = create_state("r1", NS, 1)
        ray.get(state.publish.remote(_status()))
        (tmp_path / "r1").mkdir()
        (tmp_path / "r1" / "ray_address").write_text(ray.get_runtime_context().gcs_address)

        status = _gyre("status", "r1", "--run-dir", str(tmp_path))
        assert status.returncode == 0, status.stdout + status.stderr
        lines = status.stdout.splitlines()
        assert lines[0].startswith(f"run r1 (namespace {NS})")
        assert lines[3].split() == ["learner", "12", "127.0.0.1", "3", "1", "-", "127.0.0.1:5001"]

        scale = _gyre("scale", "rollout", "3", "--run", "r1", "--run-dir", str(tmp_path))
        assert scale.returncode == 0 and "rollouts 1 → 3" in scale.stdout, scale.stdout + scale.stderr
        bad = _gyre("restart", "critic", "--run", "r1", "--run-dir", str(tmp_path))
        assert bad.returncode == 2 and "no service 'critic' in run r1" in " ".join(bad.stdout.split())
        assert _gyre("checkpoint", "--run", "r1", "--run-dir", str(tmp_path)).returncode == 0
        assert ray.get(state.take_requests.remote()) == {"rollouts": 3, "restart": [], "checkpoint": True,
                                                       "reward_swaps": []}

        gcs = (tmp_path / "r1" / "ray_address").read_text()
        ghost = _gyre("status", "ghost", "--address", gcs)
        assert ghost.returncode == 2
        assert f"no running gyre run named ghost in namespace {NS} (running: r1)" in " ".join(ghost.stdout.split())
    finally:
        ray.shutdown()
