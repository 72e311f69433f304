"""The whole loop on a tiny random Llama named by Hub id (``model: gyre-test/tiny-llama``, from a pre-populated
offline HF cache; real vLLM, DeepSpeed, gRPC, a local Ray), then
`gyre run --resume auto` on its directory: it continues the run, a finished run says so.

One directory, three runs: a 3-step run with held-out evaluations before, during (``eval.every_steps: 2``)
and after, its resume to 5 steps (a periodic evaluation again), and a third start that finds the run finished (one test: a whole run costs ~45 s to start).
"""

import io
import json

import pytest
from rich.console import Console

from gyre.services.cli.invariants import check_run
from gyre.services.control.orchestration import controller
from gyre.services.control.recipe.schema import load_recipe
from gyre.services.control.outputs.report import read_metrics
from tests.hf_cache import TINY_ID, populate_hf_cache, use_hf_cache
from tests.training import assert_trained

pytestmark = pytest.mark.slow


def _recipe(tmp_path, steps, eval_after=True):
    """The tiny Llama by Hub id (``model: gyre-test/tiny-llama``), resolved from the pre-populated HF cache."""
    return load_recipe("deploy/recipes/tiny-test.yaml", {
        "model": TINY_ID, "run_dir": str(tmp_path), "ray.num_cpus": 2, "learner.num_steps": steps,
        "learner.save_interval": 1, "learner.resume": "auto", "eval_after": eval_after, "eval.every_steps": 2})


@pytest.fixture
def hub_cache(tiny_llama, tmp_path, monkeypatch):
    """An offline HF cache holding the tiny Llama as ``gyre-test/tiny-llama``; yields its commit."""
    commit = populate_hf_cache(tmp_path / "hf-cache", TINY_ID, tiny_llama)
    use_hf_cache(monkeypatch, tmp_path / "hf-cache")
    return commit


def _check_time_breakdown(steps):
    """Each step row says where its time went (docs/guides/monitoring.md): learner phases summing to the step,
    the fleet's rollout seconds in it."""
    learner = ["wait_data", "forward_backward", "optimizer", "checkpoint", "publish_blocking", "other"]
    for r in steps:
        parts = [r[f"time/learner/{p}_s"] for p in learner]
        assert sum(parts) == pytest.approx(r["time/learner/step_s"], abs=1e-6) and min(parts) >= -1e-9, r
        assert r["time/learner/forward_backward_s"] > 0 and r["time/learner/optimizer_s"] > 0
        assert r["time/learner/checkpoint_s"] > 0  # learner.save_interval 1
        assert all(r[f"time/rollout/{p}_s"] >= 0 for p in ("generate", "score", "insert", "weight_apply")), r
    assert sum(r["time/rollout/generate_s"] for r in steps) > 0


def _check_first_run(summary, recipe, out, initial_model):
    rows = read_metrics(out / "metrics.jsonl")
    assert_trained(out, initial_model, min_fraction=1.0)  # the dense reward gives every step a gradient
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "heldout_accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # before, one periodic evaluation (eval.every_steps 2: triggered at learner step 2, run at the version
    # rollout-0 then held) and after; each wrote its completions: 8 problems × (greedy + 1 sample)
    assert [e["eval"] for e in evals] == ["before", "periodic", "after"], evals
    assert evals[0]["version"] == 0 and 2 <= evals[1]["version"] <= 3 and evals[2]["version"] == 3
    for e in evals:
        assert e["eval/basic_arithmetic/size"] == 8 and 0 <= e["heldout_pass@1"] <= 1 and e["step"] == e["version"]
        completions = [json.loads(line) for line in (out / "eval" / f"step_{e['step']}.jsonl").read_text().splitlines()]
        assert len(completions) == 16 and sum(c["greedy"] for c in completions) == 8
        assert {c["set"] for c in completions} == {"basic_arithmetic"} and all(c["prompt"] for c in completions)
    assert all(r["loss"] == r["loss"] for r in steps)  # finite, not NaN
    _check_time_breakdown(steps)

    # At least two new policy versions reached the rollout engine, which ended on the final one.
    stats = summary["rollout_stats"][0]
    assert stats["weight_updates"] >= 2 and stats["version"] == 3
    # Trajectories generated after an update carry the new version in their spans.
    by_version = {int(k): v for k, v in summary["replay"]["inserted_by_newest_version"].items()}
    assert any(v >= 1 for v in by_version), by_version
    assert summary["replay"]["acked_groups_total"] == 3 * recipe.learner.groups_per_step

    assert any((out / "replay" / "wal").iterdir())  # replay was durable under the run dir
    assert (out / "reward_accuracy.png").stat().st_size > 0
    assert (out / "final_policy" / "config.json").is_file()
    for service in ("replay", "learner", "rollout-0"):  # each service's JSON log lines, in the run directory
        events = [json.loads(line) for line in (out / "logs" / f"{service}.log").read_text().splitlines()]
        assert events and {e["service"] for e in events} == {service}, service
    assert json.loads((out / "summary.json").read_text())["final_version"] == 3

    # gyre check: the journals and replay's state agree (every acked group trained once or still stored, ...)
    report = check_run(out)
    assert report.ok, report.to_json()
    assert report.counts["trained_groups"] == 3 * recipe.learner.groups_per_step
    assert report.counts["resumes"] == 1 and report.counts["lost_groups"] == 0
    assert report.counts["rollout_version_events"] >= 3  # setup + at least two applied versions


def test_three_learner_steps_reach_the_rollout_and_resume_auto_continues_the_run(hub_cache, tiny_llama, tmp_path):
    out = tmp_path / "tiny-test"
    recipe = _recipe(tmp_path, 3)
    assert (recipe.model_id, recipe.model_revision) == (TINY_ID, hub_cache)  # the id, pinned to its commit
    _check_first_run(controller.run(recipe), recipe, out, tiny_llama)
    resolved = json.loads((out / "recipe.json").read_text())
    assert (resolved["model_id"], resolved["model_revision"]) == (TINY_ID, hub_cache)

    console = Console(file=io.StringIO(), width=300)
    second = controller.run(_recipe(tmp_path, 5, eval_after=False), console)
    printed = console.file.getvalue()
    assert second["final_version"] == 5
    assert f"learner resumed from {out / 'checkpoints' / 'global_step_3'} (policy version 3)" in printed
    assert "replay restored" in printed
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]  # appended, nothing re-done
    evals = [r for r in rows if "heldout_accuracy" in r]  # no second "before"; the periodic one resumes at 4
    assert [e["eval"] for e in evals] == ["before", "periodic", "after", "periodic"], evals
    assert 4 <= evals[3]["version"] <= 5 and (out / "eval" / f"step_{evals[3]['version']}.jsonl").is_file()
    assert second["replay"]["acked_groups_total"] == 5 * 2  # replay's counters survived the restart

    console = Console(file=io.StringIO(), width=300)
    third = controller.run(_recipe(tmp_path, 5), console)
    assert third["already_finished"] and "run tiny-test already finished (policy version 5)" in console.file.getvalue()
