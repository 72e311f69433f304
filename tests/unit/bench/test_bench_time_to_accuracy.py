"""``bench.time_to_accuracy``'s arithmetic (curves → times → ratios) and that its three arms are configured
alike from one recipe (no training, no TRL import)."""

import pytest

from bench.tta_parts import (ARMS, QUICK, RECIPE, SMOLLM2, arm_overrides, check_curve, ratios, shared_settings,
                             time_ratio, time_to_reach, trl_settings, trl_shared_settings)


def test_time_to_reach_is_the_first_evaluated_point_at_or_above_the_target():
    curve = [[0.0, 0.1], [10.0, 0.3], [20.0, 0.25], [30.0, 0.5]]
    assert time_to_reach(curve, 0.3) == 10.0  # the first crossing, not the later dip
    assert time_to_reach(curve, 0.26) == 10.0  # no interpolation between 0 and 10 s
    assert time_to_reach(curve, 0.1) == 0.0
    assert time_to_reach(curve, 0.5) == 30.0
    assert time_to_reach(curve, 0.51) is None


def test_check_curve_names_the_bad_point():
    with pytest.raises(ValueError, match="empty"):
        check_curve([])
    with pytest.raises(ValueError, match=r"point 2 time 5.0 s must be >= 0 and after 10.0 s"):
        check_curve([[0.0, 0.1], [10.0, 0.2], [5.0, 0.3]])
    with pytest.raises(ValueError, match=r"point 1 accuracy 1.5 is outside"):
        check_curve([[0.0, 0.1], [10.0, 1.5]])


def test_time_ratio_divides_the_references_time_by_the_others_time_to_the_same_accuracy():
    sync = [[0.0, 0.1], [40.0, 0.2], [80.0, 0.4]]
    fast = [[0.0, 0.1], [20.0, 0.3], [50.0, 0.45]]
    assert time_ratio(sync, fast) == (pytest.approx(80.0 / 50.0), None)
    slow = [[0.0, 0.1], [100.0, 0.4]]
    assert time_ratio(sync, slow) == (pytest.approx(0.8), None)


@pytest.mark.parametrize("reference, other, why", [
    ([[0.0, 0.0], [10.0, 0.0]], [[0.0, 0.0], [5.0, 0.0]], "final accuracy is 0"),
    ([[0.0, 0.2], [10.0, 0.1], [20.0, 0.2]], [[0.0, 0.2], [5.0, 0.3]], "no better than at 0 s"),
    ([[0.0, 0.1], [10.0, 0.4]], [[0.0, 0.1], [5.0, 0.3]], "never reached"),
    ([[0.0, 0.1], [10.0, 0.4]], [[0.0, 0.5], [5.0, 0.6]], "already at 0.400 at 0 s"),
])
def test_time_ratio_is_none_with_a_note_when_undefined(reference, other, why):
    ratio, note = time_ratio(reference, other)
    assert ratio is None and why in note


def test_ratios_compare_sync_and_trl_against_gyre_async():
    curves = {"gyre_async": [[0.0, 0.1], [30.0, 0.3], [60.0, 0.5]],
              "gyre_sync": [[0.0, 0.1], [50.0, 0.2], [100.0, 0.3]],
              "trl": [[0.0, 0.1], [200.0, 0.6]]}
    out = ratios(curves)
    assert out["async_over_sync"] == pytest.approx(100.0 / 30.0, abs=1e-3) and out["async_over_sync_note"] is None
    assert out["trl_over_gyre"] is None and "never reached" in out["trl_over_gyre_note"]


@pytest.fixture(scope="module")
def recipes():
    if not (SMOLLM2 / "config.json").is_file():
        pytest.skip(f"{SMOLLM2} not prepared (make model)")
    from gyre.services.control.recipe.schema import load_recipe

    return {arm: load_recipe(RECIPE, arm_overrides(str(SMOLLM2), "/tmp/gyre-tta-test", arm, QUICK))
            for arm in ARMS}


def test_the_three_arms_share_every_setting_that_must_match(recipes):
    gyre = {arm: shared_settings(recipes[arm]) for arm in ("gyre_async", "gyre_sync")}
    trl = trl_shared_settings(trl_settings(recipes["trl"], "/tmp/out"), recipes["trl"])
    assert gyre["gyre_async"] == gyre["gyre_sync"] == trl
    assert trl["lr"] == 1.0e-4 and trl["group_size"] == 4 and trl["prompts_per_step"] == 2
    assert trl["max_new_tokens"] == 16 and trl["reward"] == ["reasoning_gym:basic_arithmetic"]


def test_only_the_sync_arm_gates_generation_by_policy_version(recipes):
    assert recipes["gyre_sync"].rollout.max_groups_per_version == recipes["gyre_sync"].learner.groups_per_step
    assert recipes["gyre_async"].rollout.max_groups_per_version is None
    assert recipes["gyre_async"].replay.max_staleness == 2  # the default recipe's staleness, as is
    for recipe in recipes.values():  # every saved policy is kept for the evaluator
        assert recipe.learner.keep_last_n * recipe.learner.save_interval > recipe.learner.num_steps


def test_trl_takes_the_recipes_settings_on_its_cpu_path(recipes):
    trl = trl_settings(recipes["trl"], "/tmp/out")
    assert trl["num_generations"] * (trl["generation_batch_size"] // trl["num_generations"]) == 8
    assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == trl["generation_batch_size"]
    assert (trl["use_vllm"], trl["use_cpu"], trl["bf16"], trl["shuffle_dataset"]) == (False, True, False, False)
    assert (trl["epsilon"], trl["epsilon_high"], trl["lr_scheduler_type"]) == (0.2, 0.28, "constant")


def test_arm_overrides_refuse_an_unknown_arm():
    with pytest.raises(ValueError, match="arm 'verl' is not one of"):
        arm_overrides("m", "/tmp", "verl", QUICK)


def test_the_trl_reward_is_gyres_reward_for_the_prompt_index(recipes):
    from gyre.rollout.tasks import TaskSource

    from bench.tta_trl import GyreReward, prompt_dataset

    source = TaskSource(recipes["trl"].task)
    reward = GyreReward(source)
    rows = prompt_dataset(source, 3)
    assert rows["prompt_index"] == [0, 1, 2] and rows["prompt"][1] == source.messages(source.problem(1))
    right, wrong = source.train_problem(1)["answer"], "no idea"
    completions = [[{"role": "assistant", "content": right}], [{"role": "assistant", "content": wrong}]]
    assert reward(completions, prompt_index=[1, 1], answer=["x", "x"]) == [1.0, 0.0]
    assert reward([right, right], prompt_index=[1, 2]) == [1.0, float(source.train_problem(2)["answer"] == right)]
    assert reward.__name__ == "gyre:reasoning_gym:basic_arithmetic"
