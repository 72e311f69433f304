"""Recipes fail before anything starts, naming the key and what was expected; the CLI stays small."""

import pytest

from services import cli
from services.plan import describe
from services.recipe import RecipeError, load_recipe
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
    """Changing the CLI is a deliberate act: update this test and the README together."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sorted(sub.choices) == ["export", "run"]
    run = sub.choices["run"]
    assert sorted(o for a in run._actions for o in a.option_strings) == ["--dry-run", "--help", "--set", "-h"]
    export = sub.choices["export"]
    assert [a.dest for a in export._actions if not a.option_strings] == ["checkpoint", "out_dir"]
    assert sorted(o for a in export._actions for o in a.option_strings) == ["--help", "-h"]
