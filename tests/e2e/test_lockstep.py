"""Deterministic mode: a lockstep run with a fault injected in every service ends with learner parameters
bit-identical to the same run without faults (tiny random Llama; real vLLM, DeepSpeed, gRPC, local Ray).

The faulty run kills the learner inside its second checkpoint commit (it resumes from the first and
re-trains two steps), replay before a WAL fsync, and rollout-0 while it loads a policy version (its prompt
leases expire and are re-issued, so those groups are generated again by its next incarnation).

The claim only means something if the runs train and the comparison can tell runs apart: the tiny-test recipe's
dense reward gives every step a gradient (asserted, and the final policy is not the initial model), and a
control run that differs from the clean one in its prompt stream only (``task.seed``) must end with different
parameters. The fire log shows that each armed fault fired in the incarnation it was armed for. Every step's
batch is exactly ``lockstep_lag`` versions behind the learner (fewer in the first steps), faults or not.
"""

import pytest
from safetensors.torch import load_file

from gyre import faults
from gyre.services.cli.invariants import check_run
from gyre.services.control.orchestration import controller
from gyre.services.control.orchestration.factory import FIRE_LOG
from gyre.services.control.recipe.schema import load_recipe
from tests.training import assert_trained

pytestmark = pytest.mark.slow

STEPS = 6
GROUPS_PER_STEP = 2
LAG = 1
FAULTS = {"learner": ["learner.ckpt.before_rename#2"], "replay": ["replay.wal.before_fsync#20"],
          "rollout-0": ["rollout.apply_weights#3"]}


def _run(tiny_llama, run_dir, faults_section, overrides=None):
    recipe = load_recipe("deploy/recipes/tiny-test.yaml", {
        "model": str(tiny_llama), "run_dir": str(run_dir), "ray.num_cpus": 2, "eval_before": False,
        "eval_after": False, "determinism": "lockstep", "lockstep_lag": LAG, "learner.num_steps": STEPS,
        "learner.groups_per_step": GROUPS_PER_STEP,
        "learner.save_interval": 2, "learner.engine.dtype": "fp32", "replay.prompt_lease_ttl_s": 10.0,
        # replay's default lease_ttl_s (600 s) is above the learner's sample_timeout_s (300 s in tiny-test): a
        # Sample whose lease was logged but whose answer died with replay gets that lease again on its retry
        # (request_id); before that, the restored lease held those prompts' groups and the run failed.
        "faults": faults_section, **(overrides or {})})
    summary = controller.run(recipe)
    out = run_dir / "tiny-test"
    report = check_run(out)  # nothing lost or trained twice, even though every service crashed once
    assert report.ok and report.counts["lost_groups"] == 0, report.to_json()
    assert report.counts["duplicates_trained"] == 0
    assert report.counts["trained_groups"] == STEPS * GROUPS_PER_STEP, report.to_json()
    rows = assert_trained(out, tiny_llama, min_fraction=1.0)
    # step s trains the prompts version max(0, s - 1 - LAG) generated, at version s - 1: the lag is exact
    assert [r["staleness_mean"] for r in rows] == [float(min(r["step"] - 1, LAG)) for r in rows], rows
    fired = sorted((r["service"], r["incarnation"], r["point"]) for r in faults.read_fire_log(out / FIRE_LOG))
    params = load_file(str(next((out / "final_policy").glob("*.safetensors"))))
    return summary, params, [r["step"] for r in rows], fired


def _differing(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if not a[n].equal(b[n])]


def test_faults_in_every_service_leave_the_lockstep_result_bit_identical(tiny_llama, tmp_path):
    clean, clean_params, clean_steps, clean_fired = _run(tiny_llama, tmp_path / "clean", {})
    faulty, faulty_params, faulty_steps, faulty_fired = _run(tiny_llama, tmp_path / "faulty", FAULTS)
    _, control_params, _, _ = _run(tiny_llama, tmp_path / "control", {}, {"task.seed": 2})

    assert clean["final_version"] == faulty["final_version"] == STEPS
    assert clean_steps == list(range(1, STEPS + 1))
    assert faulty_steps[-1] == STEPS and sorted(set(faulty_steps)) == list(range(1, STEPS + 1))
    assert all(v == 0 for v in clean["restarts"].values()), clean["restarts"]
    assert clean_fired == []
    assert faulty_fired == sorted((svc, 0, point) for svc, (spec,) in FAULTS.items() for point in faults.parse_spec(spec))
    assert {name: faulty["restarts"][name] for name in FAULTS} == {name: 1 for name in FAULTS}, faulty["restarts"]
    # the comparison can tell runs apart: other prompts, other trained parameters
    assert len(_differing(clean_params, control_params)) * 2 > len(clean_params)
    different = _differing(clean_params, faulty_params)
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"
