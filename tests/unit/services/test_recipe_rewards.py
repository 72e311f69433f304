"""A recipe's reward functions and Ray runtime_env: relative paths resolve from the directory gyre runs in (as the
model and dataset paths do), a reward
that does not load is refused when the recipe loads (naming its path), and the rollout actors — where rewards
are imported — get the runtime_env."""

import pytest
import yaml

from gyre.services.common.logs import LOG_DIR_ENV
from gyre.services.control.orchestration.factory import ServiceFactory
from gyre.services.control.recipe.schema import RecipeError, load_recipe
from tests.tiny_model import SMOLLM2_DIR
from tests.unit.services.test_fault_arming import FakeActorClass

REWARD = "def score(completions, **columns):\n    return [float(len(c) < 9) for c in completions]\n"


def write_recipe(folder, task_reward: dict, ray: dict | None = None):
    data = yaml.safe_load(open("deploy/recipes/tiny-test.yaml"))
    data.update(model=str(SMOLLM2_DIR.resolve()), run_dir=str(folder / "runs"))
    data["task"] = {k: v for k, v in data["task"].items() if k != "reward"} | task_reward
    if ray is not None:
        data["ray"] = ray
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_relative_reward_files_and_runtime_env_resolve_from_the_working_directory(tmp_path, monkeypatch):
    folder = tmp_path / "exp"
    (folder / "lib").mkdir(parents=True)
    (folder / "reward.py").write_text(REWARD)
    path = write_recipe(folder, {"rewards": [{"function": "reward.py:score", "weight": 0.5}, "math_exact"]},
                        {"runtime_env": {"working_dir": ".", "py_modules": ["lib", "s3://bucket/m.zip"],
                                         "env_vars": {"MY_VAR": "1", "PYTHONPATH": "mine"}}})
    monkeypatch.chdir(folder)  # where gyre runs; the recipe is named by an absolute path
    recipe = load_recipe(path)
    assert recipe.task.rewards[0].function == f"{folder}/reward.py:score"
    assert recipe.ray.runtime_env["working_dir"] == str(folder)
    assert recipe.ray.runtime_env["py_modules"] == [str(folder / "lib"), "s3://bucket/m.zip"]
    factory = ServiceFactory(recipe, {"PYTHONPATH": "/repo"}, "fp")
    logs = str(recipe.out_dir.resolve() / "logs")
    rollout = factory._create(FakeActorClass(), "rollout", "rollout-0").opts["runtime_env"]
    assert rollout == {"working_dir": str(folder), "py_modules": [str(folder / "lib"), "s3://bucket/m.zip"],
                       "env_vars": {"MY_VAR": "1", "PYTHONPATH": "/repo", LOG_DIR_ENV: logs}}  # gyre's env_vars win
    for role in ("replay", "learner"):  # only the rollouts import rewards
        assert factory._create(FakeActorClass(), role, role).opts["runtime_env"] == {"env_vars": {"PYTHONPATH": "/repo", LOG_DIR_ENV: logs}}


@pytest.mark.parametrize("source, message", [
    (None, "file {dir}/reward.py does not exist"),
    ("def score(completions):\n    return []\n", "got an unexpected keyword argument 'prompts'"),
    ("def score(completions, prompts):\n    return []\n", "cannot take the keywords prompts, completion_ids and the "
                                                          "entry's columns ['answer', 'metadata', 'question']"),
])
def test_a_reward_function_that_cannot_run_is_refused_when_the_recipe_loads(tmp_path, monkeypatch, source, message):
    if source is not None:
        (tmp_path / "reward.py").write_text(source)
    path = write_recipe(tmp_path, {"reward": {"function": "reward.py:score"}})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(err.value).startswith(f"recipe {path}: task: ")
    assert message.format(dir=tmp_path) in str(err.value) and f"{tmp_path}/reward.py:score" in str(err.value)
