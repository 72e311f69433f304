"""``services.control.outputs.run_dir``: the one reader of a run directory's ``recipe.json`` (check, compare, reward swap
and a recorded source all go through it)."""

from __future__ import annotations

import json

import pytest

from gyre.services.cli.compare import CompareError, load_run
from gyre.services.cli.run_records import load_run as load_records
from gyre.services.control.recipe.schema import load_recipe
from gyre.services.control.recipe.recorded import recorded_replay
from gyre.services.control.outputs.run_dir import (RECIPE_FILE, RunDirError, read_recipe, read_recipe_if_any, replay_config,
                                           task_config, write_recipe)
from gyre.replay.recorded import RecordingError
from tests.unit.services.test_recipe import DEFAULT as DEFAULT_RECIPE


@pytest.fixture
def run_dir(tmp_path):
    recipe = load_recipe(DEFAULT_RECIPE, {"run_dir": str(tmp_path)})
    write_recipe(tmp_path, recipe.model_dump_json(indent=2))
    return tmp_path


def test_a_written_recipe_reads_back_as_the_configs_the_run_ran_with(run_dir):
    recipe = load_recipe(DEFAULT_RECIPE, {"run_dir": str(run_dir)})
    assert read_recipe(run_dir) == json.loads(recipe.model_dump_json())
    assert replay_config(run_dir).model_dump(exclude={"dir"}) == recipe.replay.model_dump(exclude={"dir"})
    assert replay_config(run_dir).dir == str(run_dir / "replay")  # replay.dir unset: the run's own replay/
    assert task_config(run_dir) == recipe.task


def test_an_explicit_replay_dir_is_kept(run_dir):
    data = read_recipe(run_dir)
    data["replay"]["dir"] = "/elsewhere/replay"
    (run_dir / RECIPE_FILE).write_text(json.dumps(data))
    assert replay_config(run_dir).dir == "/elsewhere/replay"


def test_a_directory_without_a_recipe_is_named_with_what_was_expected(tmp_path):
    with pytest.raises(RunDirError, match=f"{tmp_path} is not a run directory: no recipe.json"):
        read_recipe(tmp_path)
    assert read_recipe_if_any(tmp_path) is None
    with pytest.raises(RecordingError, match=f"{tmp_path} is not a recorded run's directory: no recipe.json"):
        recorded_replay(tmp_path)
    with pytest.raises(RunDirError, match="is not a run directory"):
        load_records(tmp_path)


@pytest.mark.parametrize("text, message", [("{not json", "does not read as JSON"),
                                           ("[1, 2]", "holds a list; expected a JSON object"),
                                           ('{"replay": {"capacity_groups": "many"}}', "unreadable replay section"),
                                           ('{"replay": {}}', "has no task section")])
def test_a_broken_recipe_is_refused_naming_the_file(tmp_path, text, message):
    (tmp_path / RECIPE_FILE).write_text(text)
    with pytest.raises(RunDirError, match=message) as info:
        replay_config(tmp_path) if "task" not in message else task_config(tmp_path)
    assert str(tmp_path / RECIPE_FILE) in str(info.value)


def test_compare_reads_the_recipe_through_it(run_dir):
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    assert load_run(run_dir).recipe == read_recipe(run_dir)
    (run_dir / RECIPE_FILE).write_text("{not json")
    with pytest.raises(CompareError, match="does not read as JSON"):
        load_run(run_dir)
