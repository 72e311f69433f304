"""Each tracker backend with its real library, writing into a temporary run directory, read back with that
library's own reader (tests/tracking_stores.py): TensorBoard event files, the MLflow file store, W&B's offline
run file, trackio's SQLite store. W&B runs offline only (tests/conftest.py sets ``WANDB_MODE=offline``)."""

import json
import uuid
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gyre.services.control.outputs.tracking import TrackingConfig, open_trackers
from tests.tracking_stores import (
    mlflow_history, mlflow_run, tensorboard_scalars, tensorboard_texts, trackio_logs, wandb_offline_runs,
)

RECIPE = {"name": "t", "learner": {"engine": {"lr": 0.001}, "num_steps": 3}, "eval": {"sets": ["arith"]},
          "faults": {}}
T0 = 1_790_000_000.0
ROWS = [{"step": s, "version": s, "time": T0 + s, "loss": 2.0 ** (1 - s), "reward_mean": 0.1 * s,
         "rollout_reward_means": {"char_fraction": 0.5}, "rollout_versions": [s]} for s in (1, 2, 3)]
# a periodic evaluation of version 2 collected after training step 3 was written
EVAL = {"step": 2, "version": 2, "time": T0 + 3.5, "eval": "periodic", "heldout_accuracy": 0.5, "heldout_pass@1": 0.75,
        "eval/arith/greedy_accuracy": 0.5}
COMPLETIONS = [{"set": "arith", "index": 0, "greedy": False, "prompt": "1+1", "completion": "3", "reward": 0.0},
               {"set": "arith", "index": 0, "greedy": True, "prompt": "1+1", "completion": "2 | two", "reward": 1.0,
                "answer": "2"}]


def _run(tmp_path, config, rows=ROWS, eval_row=EVAL, final=3):
    """One run's calls, as the controller makes them; returns the fan-out after closing it."""
    trackers = open_trackers(config, tmp_path, "t", RECIPE)
    assert trackers.failed == {}
    for row in rows:
        trackers.log_row(row)
    if eval_row is not None:
        trackers.log_row(eval_row)
        trackers.log_completions(COMPLETIONS, eval_row["step"])
    trackers.log_summary({"final_version": final, "run": "t", "replay": {"acked_groups_total": 2 * final}}, final)
    trackers.close()
    return trackers


def _only(**sections):
    return TrackingConfig.model_validate({"tensorboard": False, **sections})


def test_tensorboard_events_hold_each_metric_by_step_and_wall_time_and_the_tables_as_text(tmp_path):
    _run(tmp_path, TrackingConfig())
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert [(s, v, t) for s, v, t in scalars["loss"]] == [(1, 1.0, T0 + 1), (2, 0.5, T0 + 2), (3, 0.25, T0 + 3)]
    assert [(s, round(v, 6)) for s, v, _ in scalars["reward_mean"]] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [(s, v) for s, v, _ in scalars["heldout_pass@1"]] == [(2, 0.75)]
    assert [(s, v) for s, v, _ in scalars["rollout_reward_means/char_fraction"]] == [(1, 0.5), (2, 0.5), (3, 0.5)]
    assert "version" not in scalars and "time" not in scalars
    texts = tensorboard_texts(tmp_path / "tb")
    assert "| learner.engine.lr | 0.001 |" in texts["recipe"][0][1]
    (step, table), = texts["eval/completions"]
    assert step == 2 and table.splitlines()[2] == "| arith | 0 | True | 1+1 | 2 \\| two | 2 | 1.0 |"
    assert "| final_version | 3 |" in texts["summary"][0][1] and texts["summary"][0][0] == 3


def test_mlflow_store_holds_metrics_params_the_table_artifact_and_a_resumed_run_continues_it(tmp_path):
    _run(tmp_path, _only(mlflow={"experiment": "gyre-unit"}))
    run_id = json.loads((tmp_path / "tracking.json").read_text())["mlflow"]
    uri = (tmp_path / "mlruns").as_uri()
    assert mlflow_history(uri, run_id, "loss") == [(1, 1.0, int((T0 + 1) * 1000)), (2, 0.5, int((T0 + 2) * 1000)),
                                                   (3, 0.25, int((T0 + 3) * 1000))]
    assert [(s, v) for s, v, _ in mlflow_history(uri, run_id, "heldout_pass_at_1")] == [(2, 0.75)]
    assert [(s, v) for s, v, _ in mlflow_history(uri, run_id, "eval/arith/greedy_accuracy")] == [(2, 0.5)]
    assert [(s, v) for s, v, _ in mlflow_history(uri, run_id, "summary/final_version")] == [(3, 3.0)]
    run, client = mlflow_run(uri, run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "t"
    assert run.data.params["learner.engine.lr"] == "0.001" and run.data.params["eval.sets"] == '["arith"]'
    assert client.get_experiment(run.info.experiment_id).name == "gyre-unit"
    table = json.loads(Path(client.download_artifacts(run_id, "eval/completions_step_2.json", str(tmp_path / "dl")))
                       .read_text())
    assert table["columns"][:5] == ["set", "index", "greedy", "prompt", "completion"]
    assert table["data"][0][4] == "2 | two" and len(table["data"]) == 2

    # gyre run --resume: the same MLflow run goes on (steps 4, 5), the params it had are kept
    resumed = {**RECIPE, "learner": {**RECIPE["learner"], "num_steps": 5}}
    trackers = open_trackers(_only(mlflow={"experiment": "gyre-unit"}), tmp_path, "t", resumed)
    assert trackers.failed == {} and mlflow_run(uri, run_id)[0].info.status == "RUNNING"
    trackers.log_row({"step": 4, "time": T0 + 4, "loss": 0.25})
    trackers.close()
    assert [s for s, _, _ in mlflow_history(uri, run_id, "loss")] == [1, 2, 3, 4]
    assert mlflow_run(uri, run_id)[0].info.status == "FINISHED"


def test_mlflow_that_cannot_start_warns_once_and_tensorboard_goes_on(tmp_path):
    with capture_logs() as logs:
        trackers = open_trackers(TrackingConfig.model_validate({"mlflow": {"tracking_uri": "bogus://nowhere"}}),
                                 tmp_path, "t", RECIPE)
        for row in ROWS:
            trackers.log_row(row)
        trackers.close()
    failures = [e for e in logs if e["event"] == "tracker_failed"]
    assert [(e["tracker"], e["during"]) for e in failures] == [("mlflow", "start")] and "bogus" in failures[0]["error"]
    assert [s for s, _, _ in tensorboard_scalars(tmp_path / "tb")["loss"]] == [1, 2, 3]


def test_wandb_offline_run_holds_config_history_by_learner_step_the_table_and_summary(tmp_path):
    _run(tmp_path, _only(wandb={"mode": "offline", "project": "gyre-unit", "group": "lag2", "tags": ["tis"]}))
    (run,) = wandb_offline_runs(tmp_path)
    assert json.loads((tmp_path / "tracking.json").read_text()) == {"wandb": run.run_id}
    assert (run.project, run.display_name, run.group, run.tags) == ("gyre-unit", "t", "lag2", ["tis"])
    assert run.config["learner.engine.lr"] == 0.001 and run.config["eval.sets"] == ["arith"]
    rows = [h for h in run.history if "loss" in h]
    assert [(h["learner_step"], h["loss"]) for h in rows] == [(1, 1.0), (2, 0.5), (3, 0.25)]
    (ev,) = [h for h in run.history if "heldout_pass@1" in h]
    assert ev["learner_step"] == 2 and ev["eval/arith/greedy_accuracy"] == 0.5  # logged after step 3, kept
    (table_row,) = [h for h in run.history if "eval/completions/_type" in h]
    assert table_row["learner_step"] == 2 and table_row["eval/completions/_type"] == "table-file"
    table = json.loads((tmp_path / "wandb").glob("offline-run-*/files").__next__()
                       .joinpath(table_row["eval/completions/path"]).read_text())
    assert table["columns"][3:5] == ["prompt", "completion"] and table["data"][0][4] == "2 | two"
    assert run.summary["final_version"] == 3 and run.summary["replay.acked_groups_total"] == 6
    assert run.exit_code == 0

    # gyre run --resume: the same W&B run id again (W&B merges the two offline folders on sync)
    _run(tmp_path, _only(wandb={"mode": "offline", "project": "gyre-unit"}), rows=[{"step": 4, "loss": 0.25}],
         eval_row=None, final=4)
    assert [r.run_id for r in wandb_offline_runs(tmp_path)] == [run.run_id, run.run_id]


def test_trackio_store_holds_metrics_by_step_the_table_and_the_config(tmp_path):
    project = f"gyre-unit-{uuid.uuid4().hex[:8]}"
    _run(tmp_path, _only(trackio={"project": project}))
    assert json.loads((tmp_path / "tracking.json").read_text()) == {"trackio": "t"}
    rows, config = trackio_logs(project, "t")
    assert [(r["step"], r["loss"]) for r in rows if "loss" in r] == [(1, 1.0), (2, 0.5), (3, 0.25)]
    (ev,) = [r for r in rows if "heldout_pass@1" in r]
    assert ev["step"] == 2
    (table,) = [r["eval/completions"] for r in rows if "eval/completions" in r]
    assert table["_type"] == "trackio.table" and table["_value"][0]["completion"] == "2 | two"
    assert config["learner.engine.lr"] == 0.001
    assert [(r["step"], r["summary/final_version"]) for r in rows if "summary/final_version" in r] == [(3, 3.0)]


@pytest.mark.parametrize("section", ["wandb", "trackio"])
def test_a_backend_whose_init_raises_warns_once_and_the_run_goes_on(tmp_path, section):
    # names each library refuses: W&B a project with "/", trackio one in its reserved "registry-" namespace
    bad = {"wandb": {"mode": "offline", "project": "no/slashes allowed"}, "trackio": {"project": "registry-x"}}
    with capture_logs() as logs:
        trackers = open_trackers(TrackingConfig.model_validate({section: bad[section]}), tmp_path, "t", RECIPE)
        trackers.log_row(ROWS[0])
        trackers.close()
    assert [(e["tracker"], e["during"]) for e in logs if e["event"] == "tracker_failed"] == [(section, "start")]
    refusal = {"wandb": "UsageError: Invalid project name 'no/slashes allowed'", "trackio": "ValueError: Project name 'registry-x'"}
    assert list(trackers.failed) == [section] and trackers.failed[section].startswith(refusal[section])
    assert [s for s, _, _ in tensorboard_scalars(tmp_path / "tb")["loss"]] == [1]
