"""The own-data example (``examples/own-data``): its recipe loads (dataset, column mapping, a reward function gyre
has never seen), its reward scores by TRL's convention, and its data files are what ``make_data.py`` writes."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

from gyre.rollout.rewards.function import Group
from gyre.rollout.rewards.scoring import score_groups
from gyre.rollout.tasks import TaskSource
from gyre.services.control.recipe.schema import load_recipe

EXAMPLE = Path("examples/own-data")


def test_the_example_recipe_loads_and_its_reward_scores_exactly():
    recipe = load_recipe(EXAMPLE / "recipe.yaml")
    assert recipe.task.dataset.columns.prompt == "problem" and recipe.task.reward.function.endswith("reward.py:exact_integer")
    task = TaskSource(recipe.task)
    problem = task.problem(0)
    assert problem.question.endswith("Give only the final number.") and "difficulty" in problem.entry
    assert len(task.heldout()) == 128 and not {p.question for p in task.heldout()} & {
        task.problem(i).question for i in range(300)}
    gold = problem.entry["solution"]
    group = Group([f"The answer is {gold}.", f"{gold}1", "no idea"], [task.messages(problem)] * 3, problem.entry)
    (score,) = asyncio.run(score_groups([(task.reward_for(problem.task), group)]))
    assert [r.reward for r in score.results] == [1.0, 0.0, 0.0] and not any(r.error for r in score.results)


def test_the_data_files_are_what_make_data_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_data", EXAMPLE / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    make_data.main(tmp_path)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE / name).read_bytes(), name
