"""A whole run off loopback with TLS and no token given (``security.auto_token``): every service binds every
interface and dials the others at the node's IP over TLS with the run's own generated token (replay, learner, the
weights, the rollouts: ``services.common.run_token``); the run trains; the token is in ``runs/NAME/security/
run.token`` (0600) and nowhere else in the run directory (not in ``recipe.json``, no log line). Before, such a
recipe was refused for lacking authentication. Tiny random Llama, DeepSpeed, gRPC, local Ray; the rollouts on the
simulated engine (``tests.engines``: the transport is tested, not vLLM)."""

import json
import stat

import pytest
import ray

from gyre.services.common.run_token import TOKEN_FILE
from gyre.services.control.orchestration import controller
from gyre.services.control.recipe.plan import placement_lines
from gyre.services.control.recipe.schema import load_recipe
from tests.engines import TINY_GROUP_S, sim_engine
from tests.pki import cluster_certs
from tests.training import assert_trained

pytestmark = pytest.mark.slow
STEPS = 2


def test_a_run_off_loopback_with_tls_alone_authenticates_with_its_own_token(tiny_llama, tmp_path):
    certs = cluster_certs(tmp_path / "pki", ["127.0.0.1", ray.util.get_node_ip_address()])
    recipe = load_recipe("deploy/recipes/tiny-test.yaml", {
        "model": str(tiny_llama), "run_dir": str(tmp_path / "runs"), "ray.num_cpus": 2, "eval_before": False,
        "eval_after": False, "learner.num_steps": STEPS, "rollout.num_workers": 2,
        "security": {"bind_host": "0.0.0.0", "tls": True, **certs}, **sim_engine(TINY_GROUP_S)})
    assert recipe.security.needs_run_token
    assert "security   bind 0.0.0.0 tls=True token=generated per run" in placement_lines(recipe)  # --dry-run says so
    summary = controller.run(recipe)
    assert summary["final_version"] == STEPS
    out = recipe.out_dir
    assert [r["step"] for r in assert_trained(out, tiny_llama, min_fraction=1.0)] == list(range(1, STEPS + 1))
    token_file = out / TOKEN_FILE
    token = token_file.read_text().strip()
    assert len(token) == 64 and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert json.loads((out / "recipe.json").read_text())["security"].get("token_file") is None
    leaks = [p for p in out.rglob("*") if p.is_file() and p != token_file and token.encode() in p.read_bytes()]
    assert not leaks, leaks
