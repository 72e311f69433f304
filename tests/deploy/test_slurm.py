"""``sbatch --wait deploy/slurm.sbatch RECIPE`` on a one-node Slurm on loopback (``tests/deploy/slurmnode.py``).

Skipped, with the reason, where ``slurm-wlm`` cannot be installed or its daemons cannot start here.

The recipe's rollout runs the simulated engine (``tests.engines``): the launcher is tested, not vLLM. Its roles are
pinned with custom Ray resources (``placement.<role>.resources``, as the cluster recipes pin them to node types):
the batch script must start Ray with what the recipe asks for (``deploy/slurm_layout.py``), else replay is never
placed and the run waits until the job is killed (before the layout, Ray started with none).
"""

import json
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.deploy.slurmnode import PACKAGES, LoopbackSlurm
from tests.deploy.system import (REPO, VENV_BIN, ensure_debian_packages, free_port_range, free_ports,
                                 pid_namespace_problem, ray_session_logs, tail_file, tail_text)
from tests.engines import sim_engine_sets
from tests.training import assert_trained

pytestmark = pytest.mark.slow

RECIPE = "deploy/recipes/tiny-cluster.yaml"
PINNED = ["--set", "placement.replay.resources={gyre_replay: 1}", "--set", "placement.learner.resources={gyre_learner: 1}",
          "--set", "placement.rollout.resources={gyre_rollout: 1}"]
"""Each role on its own custom resource: the head must advertise replay's, both learner ranks' and the rollouts'."""


@pytest.fixture
def slurm():
    reason = ensure_debian_packages(PACKAGES) or pid_namespace_problem()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="gyre-slurm-", dir="/tmp"))
    cluster = LoopbackSlurm(root)
    try:
        cluster.start()
    except RuntimeError as exc:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"a one-node Slurm cannot start here: {exc}")
    yield cluster
    cluster.stop()
    shutil.rmtree(root, ignore_errors=True)


def _ray_processes(temp_dir: Path) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines() if f"--session-dir={temp_dir}" in line]


def test_sbatch_runs_a_recipe_and_stops_its_ray(slurm, tiny_llama, tmp_path):
    temp_dir = Path(tempfile.mkdtemp(prefix="gyre-ray-", dir="/tmp"))
    gcs, agent, client = ports = free_ports(3)
    env = {**slurm.env, "GYRE_HOME": str(REPO), "GYRE_RAY_PORT": str(gcs), "GYRE_RAY_AGENT_PORT": str(agent),
           "GYRE_RAY_CLIENT_PORT": str(client), "GYRE_RAY_MIN_WORKER_PORT": str(free_port_range(200, exclude=ports)),
           "GYRE_RAY_TEMP_DIR": str(temp_dir), "RAY_AUTH_MODE": "disabled", "GYRE_ALLOW_CPU": "1", "PATH": f"{VENV_BIN}:/usr/bin:/bin"}
    job_log, run_dir = tmp_path / "job.out", tmp_path / "runs"
    try:
        proc = subprocess.run(["sbatch", "--wait", f"--output={job_log}", f"--chdir={REPO}", "deploy/slurm.sbatch",
                               RECIPE, "--set", f"model={tiny_llama}", "--set", f"run_dir={run_dir}", *sim_engine_sets(), *PINNED],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
        assert proc.returncode == 0, (f"sbatch exited {proc.returncode}: {proc.stdout}{proc.stderr}\n--- job\n"
                                      f"{tail_file(job_log, 60)}\n{slurm.logs()}\n{ray_session_logs(temp_dir)}")
        log = job_log.read_text()
        assert f"Ray head on {socket.gethostname()}" in log, tail_file(job_log)
        plan = ('node 0 (head): 0 GPU(s); replay x1, learner x2, rollout (no GPU limit); resources '
                '{"gyre_learner": 2.0, "gyre_replay": 1.0, "gyre_rollout": 1024.0}')
        assert plan in log, tail_file(job_log)

        out = run_dir / "tiny-cluster"
        assert json.loads((out / "summary.json").read_text())["final_version"] == 1
        assert [r["step"] for r in assert_trained(out, tiny_llama, min_fraction=1.0)] == [1]  # it trained
        # `auto` never starts a private head: the run joined the job's head or failed.
        assert json.loads((out / "recipe.json").read_text())["ray"]["address"] == "auto"

        # Leaving the batch script stopped the Ray head it started.
        deadline = time.monotonic() + 60
        while (left := _ray_processes(temp_dir)) and time.monotonic() < deadline:
            time.sleep(2)
        assert not left, "Ray processes outlived the Slurm job:\n" + tail_text("\n".join(left), 10)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
