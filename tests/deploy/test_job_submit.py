"""``ray job submit --working-dir . -- gyre run RECIPE`` against a head started here with gyre's venv.

The head is ``ray start --head --block`` on free ports with its own temp dir (in its own PID namespace
where the machine allows one), so it cannot collide with other Ray instances, and stopping it stops
everything it started. Token auth is on, with a token generated for the test.

The recipe's rollout runs the simulated engine (``tests.engines``): the launcher is tested, not vLLM.
"""

import json
import secrets
import shutil
import uuid

import pytest

from tests.deploy.raycluster import head_env, pick_head_ports, ray_cli, start_blocking_head, wait_for_job_api
from tests.deploy.system import ray_session_logs, stop_process, tail_file, tail_text
from tests.engines import sim_engine_sets
from tests.training import assert_trained

pytestmark = pytest.mark.slow

RECIPE = "deploy/recipes/tiny-cluster.yaml"


def test_job_submit_runs_a_recipe(tiny_llama, tmp_path):
    token = tmp_path / "ray_auth_token"
    token.write_text(secrets.token_hex(32))
    env, ports = head_env(auth_token=token), pick_head_ports()
    run_dir, job_id, head_log = tmp_path / "runs", f"gyre-test-{uuid.uuid4().hex[:8]}", tmp_path / "head.log"
    address = f"http://127.0.0.1:{ports.dashboard}"
    head = start_blocking_head(ports, head_log, env)
    try:
        assert wait_for_job_api(address, head, env, timeout_s=180), \
            f"head not serving jobs:\n{tail_file(head_log)}\n{ray_session_logs(ports.temp_dir)}"
        job = ray_cli(["job", "submit", "--address", address, "--submission-id", job_id, "--working-dir", ".",
                       "--", "gyre", "run", RECIPE, "--set", f"model={tiny_llama}", "--set", f"run_dir={run_dir}", *sim_engine_sets()],
                      timeout_s=420, env=env)
        status = ray_cli(["job", "status", job_id, "--address", address], timeout_s=60, env=env)
        if job.returncode != 0 or f"Job '{job_id}' succeeded" not in status.stdout + status.stderr:
            logs = ray_cli(["job", "logs", job_id, "--address", address], timeout_s=60, env=env)
            pytest.fail(f"job {job_id}: `ray job submit` exited {job.returncode}\n{tail_text(job.stdout, 10)}\n"
                        f"--- status\n{tail_text(status.stdout + status.stderr, 5)}\n--- job logs\n"
                        f"{tail_text(logs.stdout, 60)}\n{ray_session_logs(ports.temp_dir)}")

        out = run_dir / "tiny-cluster"
        assert json.loads((out / "summary.json").read_text())["final_version"] == 1
        # the recipe's learner is two DeepSpeed ranks in a placement group: both wrote the final checkpoint
        assert json.loads((out / "checkpoints" / "global_step_1" / "metadata.json").read_text())["world_size"] == 2
        assert [r["step"] for r in assert_trained(out, tiny_llama, min_fraction=1.0)] == [1]  # it trained
        assert json.loads((out / "recipe.json").read_text())["ray"]["address"] == "auto"

        # The uploaded working dir is the source tree without what .gitignore names (.venv, .cache, runs).
        pkgs = [p for p in (ports.temp_dir / "session_latest" / "runtime_resources" / "working_dir_files").glob("*")
                if p.is_dir()]
        assert len(pkgs) == 1, pkgs
        assert (pkgs[0] / RECIPE).is_file() and (pkgs[0] / "services" / "cli" / "main.py").is_file()
        assert not any((pkgs[0] / name).exists() for name in (".venv", ".cache", "runs")), \
            sorted(p.name for p in pkgs[0].iterdir())
    finally:
        stop_process(head, timeout_s=60)
        shutil.rmtree(ports.temp_dir, ignore_errors=True)
