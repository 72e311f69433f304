"""The reward-model service under the controller, SIGKILLed mid-run (issue #25): a tiny random classifier scores
every response (mixed by weight with a verifier reward; the rollout on the simulated engine of
``tests.engines``, whose random text the classifier scores as well), its first process is killed by the fault point
``reward_model.batch_scored`` after its 4th batch — replies not sent — and the run must finish every step with the
reward model restarted exactly once, while the rollouts' waiting requests are retried against the new process.
Every trained trajectory is scored by both rewards or carries a recorded ``reward_error``; each scored one's
reward is the weighted sum, under the reward model's revision as part of ``reward_fn_version``."""

import pytest

from gyre.replay.recorded import read_recording
from gyre.rollout.rewards.base import RewardConfig
from gyre.rollout.rewards.model import model_spec
from gyre.services.cli.invariants import check_run
from gyre.services.control.orchestration import controller
from gyre.services.control.recipe.schema import load_recipe
from tests.engines import TINY_GROUP_S, sim_engine
from tests.fault.test_crash_matrix import armed_fires, fires
from tests.training import assert_trained

pytestmark = pytest.mark.slow

STEPS = 6
FAULTS = {"reward_model": ["reward_model.batch_scored#4"]}
"""The first reward-model process dies after its 4th scored batch; the restarted one runs clean."""


def test_a_killed_reward_model_is_restarted_once_and_the_run_finishes(tiny_llama, tiny_classifier, tmp_path):
    rewards = [{"model": str(tiny_classifier), "weight": 1.0, "timeout_s": 300},
               {"name": "char_fraction", "params": {"chars": "0123456789 "}, "weight": 0.5}]
    recipe = load_recipe("deploy/recipes/tiny-test.yaml", {
        "model": str(tiny_llama), "run_dir": str(tmp_path), "ray.num_cpus": 2, "name": "rm-crash",
        "eval_before": False, "eval_after": False, "faults": FAULTS, "learner.num_steps": STEPS,
        "task.reward": None, "task.rewards": rewards, "replay.wal": {"keep_segments": True},
        "reward_model.max_wait_ms": 50, **sim_engine(TINY_GROUP_S)})
    summary = controller.run(recipe)
    out = recipe.out_dir

    assert summary["final_version"] == STEPS
    assert_trained(out, tiny_llama)
    assert fires(out) == armed_fires(FAULTS)  # the kill happened where it was armed
    assert summary["restarts"] == {"replay": 0, "learner": 0, "rollout-0": 0, "reward_model": 1}
    report = check_run(out)
    assert report.ok, report.to_json()

    version = model_spec(RewardConfig(model=str(tiny_classifier))).version
    recorded = read_recording(recipe.replay.model_copy(update={"dir": str(out / "replay")}))
    rows = [r for g in recorded.groups for r in g.to_pylist()]
    assert len(rows) == STEPS * recipe.learner.groups_per_step * recipe.rollout.group_size
    for r in rows:  # every trained trajectory: scored by both rewards, or a recorded failure with reward 0
        assert r["reward_fn_version"] == f"1*{version}+0.5*char-fraction-v1:" + r["reward_fn_version"].rsplit(":", 1)[1]
        assert r["reward_error"] == "" or r["reward"] == 0.0
    scored = [r for r in rows if r["reward_error"] == ""]
    assert len(scored) >= len(rows) // 2, [r["reward_error"] for r in rows]
    assert len({round(r["reward"], 6) for r in scored}) > 1  # logits differ per response: not a constant
