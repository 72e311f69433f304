"""Experiment tracking on a whole run (tiny random Llama; real vLLM, DeepSpeed, gRPC, a local Ray): a 2-step run
with TensorBoard, MLflow (local file store) and W&B (offline) on, then each store is read back with its
library's reader (tests/tracking_stores.py) and must hold the per-step ``loss`` and ``reward_mean`` of
``metrics.jsonl``, the final evaluation, its completions table, the recipe and the summary.

W&B runs offline (tests/conftest.py sets ``WANDB_MODE=offline``; the recipe asks for it too).
"""

import json

import pytest

from services.control import controller
from services.control.recipe import load_recipe
from services.control.report import read_metrics
from tests.tracking_stores import mlflow_history, mlflow_run, tensorboard_scalars, tensorboard_texts, wandb_offline_runs

pytestmark = pytest.mark.slow

STEPS = 2


def test_tensorboard_mlflow_and_wandb_offline_hold_the_metrics_of_a_tiny_run(tiny_llama, tmp_path):
    recipe = load_recipe("deploy/recipes/tiny-test.yaml", {
        "model": str(tiny_llama), "run_dir": str(tmp_path), "ray.num_cpus": 2, "learner.num_steps": STEPS,
        "eval.before": False, "eval.after": True, "eval.n_samples": 0,
        "tracking": {"wandb": {"mode": "offline", "project": "gyre-e2e"}, "mlflow": {"experiment": "gyre-e2e"},
                     "completions_per_eval": 4}})
    summary = controller.run(recipe)
    out = tmp_path / "tiny-test"
    rows = read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    (final_eval,) = [r for r in rows if r.get("eval") == "after"]
    assert [r["step"] for r in train] == [1, 2] and summary["final_version"] == STEPS
    expected = {key: [(r["step"], r[key]) for r in train] for key in ("loss", "reward_mean")}
    ids = json.loads((out / "tracking.json").read_text())
    assert set(ids) == {"wandb", "mlflow"}

    # TensorBoard (float32 scalars), with each row's wall time
    scalars = tensorboard_scalars(out / "tb")
    for key, points in expected.items():
        assert [(s, pytest.approx(v, rel=1e-6)) for s, v in points] == [(s, v) for s, v, _ in scalars[key]], key
    assert [t for _, _, t in scalars["loss"]] == [pytest.approx(r["time"], abs=1e-3) for r in train]
    assert [(s, v) for s, v, _ in scalars["heldout_accuracy"]] == [(STEPS, pytest.approx(final_eval["heldout_accuracy"]))]
    texts = tensorboard_texts(out / "tb")
    assert texts["eval/completions"][0][0] == STEPS and len(texts["eval/completions"][0][1].splitlines()) == 2 + 4
    assert f"| final_version | {STEPS} |" in texts["summary"][0][1]

    # MLflow's file store under the run
    uri = (out / "mlruns").as_uri()
    for key, points in expected.items():
        assert [(s, v) for s, v, _ in mlflow_history(uri, ids["mlflow"], key)] == points, key
    run, client = mlflow_run(uri, ids["mlflow"])
    assert run.info.status == "FINISHED" and run.data.params["learner.num_steps"] == str(STEPS)
    assert [a.path for a in client.list_artifacts(ids["mlflow"], "eval")] == [f"eval/completions_step_{STEPS}.json"]

    # W&B's offline run folder under the run
    (wb,) = wandb_offline_runs(out)
    assert wb.run_id == ids["wandb"] and wb.project == "gyre-e2e" and wb.config["learner.num_steps"] == STEPS
    history = [h for h in wb.history if "loss" in h]
    for key, points in expected.items():
        assert [(h["learner_step"], h[key]) for h in history] == points, key
    assert [h["learner_step"] for h in wb.history if "eval/completions/_type" in h] == [STEPS]
    assert wb.summary["final_version"] == STEPS and wb.exit_code == 0
