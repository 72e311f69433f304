"""Recipes fail before anything starts, naming the key and what was expected; the CLI stays small."""

import pytest

from gyre.services.cli import main as cli
from gyre.services.control.recipe.plan import describe
from gyre.services.control.recipe.schema import RecipeError, load_recipe
from tests.tiny_model import SMOLLM2_DIR

DEFAULT = "deploy/recipes/smollm2-arith.yaml"


def test_default_recipe_resolves_and_describes():
    recipe = load_recipe(DEFAULT)
    assert recipe.rollout.engine.model == recipe.learner.engine.model == str(SMOLLM2_DIR.resolve())
    text = describe(recipe)
    assert "batch = 4 groups × 8 samples = 32 trajectories/step" in text and "ZeRO-2 bf16" in text


@pytest.mark.parametrize("overrides, message", [
    ({"rollout.engine.kv_cache": 3}, "rollout.engine.kv_cache: unknown key"),
    ({"learner.num_steps": "abc"}, "learner.num_steps: Input should be a valid integer"),
    ({"replay.max_staleness": -1}, "replay.max_staleness: Input should be greater than or equal to 0"),
    ({"model": "/no/such/model"}, "model: folder /no/such/model does not exist or has no config.json"),
    ({"task.name": "arithmetic_typo"}, "task.name 'arithmetic_typo' is not a reasoning-gym dataset"),
    ({"rollout.sampling.temperature": 0.7}, "must equal learner.algorithm.temperature (1.0)"),
    ({"rollout.sampling.top_p": 0.9}, "top_p (0.9) must be 1.0"),
    ({"rollout.engine.model": "x"}, "set the model once at top level"),
    ({"learner.engine.micro_batch_tokens": 256}, "learner.engine.micro_batch_tokens (256) is smaller than the longest "
                                                 "row a rollout can return: rollout.engine.max_model_len (512)"),
    ({"learner.engine.micro_batch_size": 4}, "micro_batch_size (4) and micro_batch_tokens (4096) are both set"),
])
def test_bad_recipe_values_are_named(overrides, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(DEFAULT, overrides)
    assert message in str(err.value)


def test_missing_and_malformed_recipe_files(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)


def test_cli_prints_one_line_per_problem_without_traceback(capsys):
    code = cli.main(["run", DEFAULT, "--dry-run", "--set", "learner.num_steps=abc", "--set", "bogus=1"])
    out = capsys.readouterr().out
    assert code == 2 and "Traceback" not in out
    assert "learner.num_steps" in out and "bogus: unknown key" in out


def test_cli_surface_is_frozen():
    """Changing the CLI is a deliberate act: update this test and docs/reference/cli.md together."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sorted(sub.choices) == ["check", "checkpoint", "compare", "eval", "export", "report", "restart",
                                   "reward", "run", "scale", "status", "sweep"]

    def options(name):
        return sorted(o for a in sub.choices[name]._actions for o in a.option_strings)

    def positionals(name):
        return [a.dest for a in sub.choices[name]._actions if not a.option_strings]

    assert options("run") == ["--dry-run", "--force-resume", "--help", "--resume", "--set", "-h"]
    assert positionals("run") == ["recipe"]
    assert positionals("export") == ["checkpoint", "out_dir"] and options("export") == ["--help", "-h"]
    assert positionals("eval") == ["model", "recipe"] and options("eval") == ["--help", "--out", "--set", "-h"]
    assert positionals("report") == ["run"] and options("report") == ["--help", "--run-dir", "-h"]
    assert positionals("check") == ["run_dir"] and options("check") == ["--help", "-h"]
    assert positionals("sweep") == ["target"] and options("sweep") == ["--dry-run", "--help", "-h"]
    assert positionals("compare") == ["runs"]
    assert options("compare") == ["--by", "--help", "--metric", "--out", "--threshold", "-h"]
    ops = ["--address", "--help", "--namespace", "--run", "--run-dir", "-h"]
    assert positionals("status") == ["run"]
    assert options("status") == sorted(set(ops) - {"--run"} | {"--json"})
    assert positionals("scale") == ["role", "count"] and options("scale") == ops
    assert positionals("restart") == ["service"] and options("restart") == ops
    assert positionals("checkpoint") == [] and options("checkpoint") == ops
    reward = next(a for a in sub.choices["reward"]._actions if a.dest == "reward_command")
    assert sorted(reward.choices) == ["swap"]
    swap = reward.choices["swap"]
    assert [a.dest for a in swap._actions if not a.option_strings] == ["config"]
    assert sorted(o for a in swap._actions for o in a.option_strings) == sorted(ops + ["--timeout"])


def test_resume_flag_reaches_the_learner_and_bad_values_are_named(capsys, tmp_path):
    code = cli.main(["run", DEFAULT, "--dry-run", "--resume", "none", "--force-resume"])
    assert code == 0 and "resume     none (forced)" in capsys.readouterr().out
    code = cli.main(["run", DEFAULT, "--dry-run", "--resume", str(tmp_path / "global_step_9")])
    out = "".join(capsys.readouterr().out.split())  # rich wraps long lines, even inside a long path
    expected = "".join(f"--resume '{tmp_path / 'global_step_9'}': expected auto, none or an existing".split())
    assert code == 2 and expected in out


def test_placement_section_is_validated_and_printed():
    recipe = load_recipe(DEFAULT, {"placement": {"learner": {"num_gpus": 1, "world_size": 2, "strategy": "SPREAD"},
                                                 "rollout": {"num_gpus": 0.5, "resources": {"rollout_nodes": 1}}}})
    assert recipe.placement.rollout.actor_options() == {"num_cpus": 0, "num_gpus": 0.5,
                                                        "resources": {"rollout_nodes": 1}}
    assert recipe.placement.learner.bundles() == [{"GPU": 1.0}, {"GPU": 1.0}]
    text = describe(recipe)
    assert "gyre:smollm2-arith:learner  ×1  num_cpus=0 num_gpus=1  world_size=2 placement group SPREAD" in text
    assert "gyre:smollm2-arith:rollout-i ×1  num_cpus=0 num_gpus=0.5 rollout_nodes=1" in text
    assert "reward_model" not in text  # no reward model: no such service


def test_the_plan_lists_the_reward_model_service(tiny_classifier):
    recipe = load_recipe(DEFAULT, {"task.reward": {"model": str(tiny_classifier)},
                                   "placement": {"reward_model": {"num_cpus": 1}}})
    assert recipe.model_rewards() == [{"model": str(tiny_classifier), "kind": "classifier", "params": {}}]
    assert f"gyre:smollm2-arith:reward_model ×1  num_cpus=1 num_gpus=0  classifier {tiny_classifier}" in describe(recipe)


def test_a_batch_that_cannot_be_sharded_over_the_ranks_is_named():
    placement = {"learner": {"world_size": 3, "strategy": "PACK"}}
    with pytest.raises(RecipeError) as err:  # the default recipe: 4 groups × 8 samples = 32 rows
        load_recipe(DEFAULT, {"placement": placement})
    assert "(32 rows) must be a multiple of placement.learner.world_size (3)" in str(err.value)
    ok = load_recipe(DEFAULT, {"placement": placement, "learner.engine.batch_split": "replicate"})
    assert ok.learner.engine.batch_split == "replicate"


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_group_baselines_refuse_a_group_size_of_one(advantage):
    with pytest.raises(RecipeError) as err:
        load_recipe(DEFAULT, {"rollout.group_size": 1, "learner.algorithm.advantage": advantage})
    assert f"rollout.group_size (1) must be >= 2 for learner.algorithm.advantage '{advantage}'" in str(err.value)
    assert load_recipe(DEFAULT, {"rollout.group_size": 2, "learner.algorithm.advantage": advantage})


def test_gae_takes_a_group_size_of_one():
    assert load_recipe(DEFAULT, {"rollout.group_size": 1, "learner.algorithm.advantage": "gae"}).rollout.group_size == 1


@pytest.mark.parametrize("placement, message", [
    ({"learner": {"world_size": 2}}, "world_size 2 > 1 needs a placement group"),
    ({"critic": {"num_gpus": 1}}, "placement.critic: unknown key"),
    ({"rollout": {"num_gpus": -1}}, "placement.rollout.num_gpus: Input should be greater than or equal to 0"),
    ({"replay": {"resources": {"ssd": 0}}}, "resources {'ssd': 0.0} must map non-empty names to amounts > 0"),
    ({"learner": {"world_size": 2, "strategy": "CLOSE"}}, "placement.learner.strategy"),
])
def test_bad_placement_is_named(placement, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(DEFAULT, {"placement": placement})
    assert message in str(err.value)


def test_the_response_budget_and_mini_batches_reach_the_learner():
    """Dr.GRPO's constant is the rollout's max_new_tokens unless set; mini-batches must split the batch evenly."""
    recipe = load_recipe(DEFAULT, {"learner.algorithm.advantage": "dr_grpo"})
    assert recipe.learner.algorithm.max_response_tokens == recipe.rollout.sampling.max_new_tokens
    assert recipe.learner.algorithm.agg_mode == "seq-mean-token-sum-norm"
    assert load_recipe(DEFAULT, {"learner.algorithm.max_response_tokens": 7}).learner.algorithm.max_response_tokens == 7
    with pytest.raises(RecipeError) as err:  # 32 rows
        load_recipe(DEFAULT, {"learner.algorithm.mini_batches": 3})
    assert "(32 rows) must be a multiple of learner.algorithm.mini_batches (3)" in str(err.value)
    assert load_recipe(DEFAULT, {"learner.algorithm.mini_batches": 4}).learner.algorithm.updates_per_batch == 4


def test_the_generation_budget_reaches_the_learner_and_the_overlong_buffer_must_fit_it():
    assert load_recipe(DEFAULT).learner.algorithm.max_response_tokens == 32  # rollout.sampling.max_new_tokens
    ok = load_recipe(DEFAULT, {"learner.algorithm.overlong_buffer_len": 8, "learner.algorithm.overlong_filter": True})
    assert ok.learner.algorithm.overlong_buffer_len == 8 and ok.learner.algorithm.max_response_tokens == 32
    with pytest.raises(RecipeError) as err:
        load_recipe(DEFAULT, {"learner.algorithm.overlong_buffer_len": 32})
    assert "overlong_buffer_len (32) must be < max_response_tokens (32)" in str(err.value)
    with pytest.raises(RecipeError) as err:
        load_recipe(DEFAULT, {"learner.algorithm.overlong_buffer_len": 8, "learner.algorithm.max_response_tokens": 24})
    assert "max_response_tokens (24) must equal rollout.sampling.max_new_tokens (32)" in str(err.value)
    with pytest.raises(RecipeError) as err:  # a bad budget is named once, where it was set
        load_recipe(DEFAULT, {"rollout.sampling.max_new_tokens": "many"})
    assert "rollout.sampling.max_new_tokens" in str(err.value) and "max_response_tokens" not in str(err.value)
