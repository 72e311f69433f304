"""The data-consistency check of a resume: the controller's task fingerprint carries a sha256 tree hash of the
dataset's files; a checkpoint written under other data is refused naming the files added, removed and changed,
and ``force`` (``--force-resume``) continues. Recipes with ``task.dataset`` load and are checked at load time."""

from __future__ import annotations

import json
import os

import pytest
from structlog.testing import capture_logs

from gyre.learner.checkpoint import store as ckpt
from gyre.rollout.dataset_files import DatasetConfig, data_fingerprint
from gyre.services.control.orchestration.controller import task_fingerprint
from gyre.services.control.recipe.plan import describe
from gyre.services.control.recipe.schema import RecipeError, load_recipe
from tests.tiny_model import REPO
from tests.unit.learner.test_learner_checkpoint import save

RECIPE = REPO / "deploy/recipes/smollm2-arith.yaml"


def write_parts(folder, parts: dict[str, list[dict]]):
    folder.mkdir(exist_ok=True)
    for name, rows in parts.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def rows(lo: int, hi: int) -> list[dict]:
    return [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(lo, hi)]


def dataset_recipe(data_path: str, **dataset):
    return load_recipe(RECIPE, {"task": {"dataset": {"path": data_path, **dataset}, "heldout_size": 2}})


def test_data_fingerprint_hashes_each_file_by_relative_path(tmp_path):
    write_parts(tmp_path / "data", {"a.jsonl": rows(0, 5), "b.jsonl": rows(5, 9)})
    fp = data_fingerprint(DatasetConfig(path=str(tmp_path / "data")))
    assert sorted(fp["data_files"]["train"]) == ["a.jsonl", "b.jsonl"]
    assert fp == data_fingerprint(DatasetConfig(path=str(tmp_path / "data" / "*.jsonl")))  # same files, same hash
    (tmp_path / "data" / "b.jsonl").write_text((tmp_path / "data" / "b.jsonl").read_text() + "\n")
    edited = data_fingerprint(DatasetConfig(path=str(tmp_path / "data")))
    assert edited["data_tree"] != fp["data_tree"] and edited["data_files"]["train"]["a.jsonl"] == \
        fp["data_files"]["train"]["a.jsonl"]


def test_a_resume_under_edited_data_is_refused_naming_the_files_and_force_continues(tmp_path):
    data = tmp_path / "data"
    write_parts(data, {"a.jsonl": rows(0, 5), "b.jsonl": rows(5, 9), "c.jsonl": rows(9, 12)})
    saved = task_fingerprint(dataset_recipe(str(data)))
    assert json.loads(saved)["data"]["dataset"]["data_files"]["train"].keys() == {"a.jsonl", "b.jsonl", "c.jsonl"}
    path = save(tmp_path / "ckpt", 1, fingerprint=saved)
    meta = ckpt.verify(path)
    ckpt.check_resumable(path, meta, task_fingerprint(dataset_recipe(str(data))), world_size=1)  # same data: fine
    write_parts(data, {"b.jsonl": rows(5, 8), "d.jsonl": rows(12, 14)})  # edit b, add d
    (data / "c.jsonl").unlink()
    current = task_fingerprint(dataset_recipe(str(data)))
    with pytest.raises(ckpt.CheckpointError) as refused:
        ckpt.check_resumable(path, meta, current, world_size=1)
    message = str(refused.value)
    assert ("data.dataset.data_files: data files added ['train/d.jsonl'], removed ['train/c.jsonl'], "
            "changed ['train/b.jsonl']") in message and "--force-resume" in message
    assert "data_tree" not in message and "task." not in message  # only the data differ
    with capture_logs() as logs:
        ckpt.check_resumable(path, meta, current, world_size=1, force=True)
    assert [e["event"] for e in logs] == ["resume_forced"]


def test_a_task_without_a_dataset_keeps_its_fingerprint():
    assert json.loads(task_fingerprint(load_recipe(RECIPE))).keys() == {"task"}  # old checkpoints still resume


def test_a_recipe_with_a_dataset_loads_with_absolute_paths_and_refuses_bad_data_at_load(tmp_path):
    write_parts(tmp_path, {"train.jsonl": rows(0, 8), "test.jsonl": rows(8, 10)})
    relative = os.path.relpath(tmp_path / "train.jsonl")
    recipe = dataset_recipe(relative, eval={"path": os.path.relpath(tmp_path / "test.jsonl")})
    ds = recipe.task.dataset
    assert ds.path == str(tmp_path / "train.jsonl") and ds.eval.path == str(tmp_path / "test.jsonl")
    assert recipe.task.components()["dataset"].dataset == ds
    assert f"task       dataset {tmp_path / 'train.jsonl'} split=train columns=" in describe(recipe)
    with pytest.raises(RecipeError, match="has no column 'question' \\(columns.prompt\\); its columns are "
                                          "\\['prompt', 'answer'\\]"):
        dataset_recipe(relative, columns={"prompt": "question"})
    with pytest.raises(RecipeError, match=f"dataset path {tmp_path}/nope.jsonl does not exist"):
        dataset_recipe(str(tmp_path / "nope.jsonl"))
    write_parts(tmp_path, {"no_answer.jsonl": [{"prompt": "Hi?"}] * 4})
    with pytest.raises(RecipeError, match="reward 'math_exact' does not fit task 'dataset': .*needs entry\\['answer'\\]"):
        dataset_recipe(str(tmp_path / "no_answer.jsonl"))
