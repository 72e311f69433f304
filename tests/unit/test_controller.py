from services.controller import archive_previous_run, task_fingerprint
from services.recipe import load_recipe
from tests.tiny_model import SMOLLM2_DIR


def test_previous_run_is_moved_aside_not_reused(tmp_path):
    out = tmp_path / "runs" / "r"
    assert archive_previous_run(out) is None
    (out / "replay").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    moved = archive_previous_run(out)
    assert not out.exists() and (moved / "metrics.jsonl").read_text() == "{}\n"
    assert moved.name.startswith("r.")


def test_task_fingerprint_changes_with_the_task():
    base = {"model": str(SMOLLM2_DIR)}
    a = task_fingerprint(load_recipe("deploy/recipes/tiny-test.yaml", base))
    b = task_fingerprint(load_recipe("deploy/recipes/tiny-test.yaml", base | {"task.heldout_size": 9}))
    assert a.startswith("task=basic_arithmetic:") and a != b
    assert a == task_fingerprint(load_recipe("deploy/recipes/tiny-test.yaml", base))
