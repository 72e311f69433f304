"""`gyre run --resume auto` continues a run in its directory; a finished run says so; `none` starts over.
Tiny random Llama, real vLLM, DeepSpeed, gRPC and a local Ray (two short runs)."""

import io

import pytest
from rich.console import Console

from services import controller
from services.recipe import load_recipe
from services.report import read_metrics

pytestmark = pytest.mark.slow


def _recipe(tiny_llama, tmp_path, steps, resume="auto"):
    return load_recipe("deploy/recipes/tiny-test.yaml", {
        "model": str(tiny_llama), "run_dir": str(tmp_path), "ray.num_cpus": 2, "learner.num_steps": steps,
        "learner.save_interval": 1, "learner.resume": resume, "eval_after": False})


def test_resume_auto_continues_and_a_finished_run_exits(tiny_llama, tmp_path):
    out = tmp_path / "tiny-test"
    first = controller.run(_recipe(tiny_llama, tmp_path, 2))
    assert first["final_version"] == 2

    console = Console(file=io.StringIO(), width=300)
    second = controller.run(_recipe(tiny_llama, tmp_path, 4), console)
    printed = console.file.getvalue()
    assert second["final_version"] == 4
    assert f"learner resumed from {out / 'checkpoints' / 'global_step_2'} (policy version 2)" in printed
    assert "replay restored" in printed
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]  # appended, nothing re-done
    assert [r["step"] for r in rows if "heldout_accuracy" in r] == [0]  # no second "before" evaluation
    assert second["replay"]["acked_groups_total"] == 4 * 2  # replay's counters survived the restart

    console = Console(file=io.StringIO(), width=300)
    third = controller.run(_recipe(tiny_llama, tmp_path, 4), console)
    assert third["already_finished"] and "run tiny-test already finished (policy version 4)" in console.file.getvalue()
