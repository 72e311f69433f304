"""The recipe's ``tracking:`` section and the tracker fan-out (``services.control.outputs.tracking``): what reaches the
trackers, and that a tracker failing at start or at any later call is reported once and turned off while the
others (and the run) go on. The backends themselves, with their real libraries: test_tracking_backends.py."""

import json
import sys

import pytest
from structlog.testing import capture_logs

from gyre.services.control.recipe.plan import describe
from gyre.services.control.recipe.schema import RecipeError, load_recipe
from gyre.services.control.outputs.report import MetricsWriter, read_metrics
from gyre.services.control.outputs.tracking import Tracker, TrackingConfig, flatten, metric_values, open_trackers
from gyre.services.control.outputs.tracking.base import TRACKING_EXTRA, completion_table, markdown_table
from tests.tiny_model import SMOLLM2_DIR

TINY = "deploy/recipes/tiny-test.yaml"


class Recording(Tracker):
    """Test double: records every call; raises ``RuntimeError`` at the call named by ``fail_on`` (its
    ``fail_after``-th one, 1-based)."""

    name = "recording"

    def __init__(self, config=None, ctx=None, name="recording", fail_on=None, fail_after=1, resume_id=None):
        self.name, self.ctx, self.calls = name, ctx, []
        self.fail_on, self.fail_after, self.resume_id, self.where = fail_on, fail_after, resume_id, f"/{name}"

    def _record(self, method, *args):
        self.calls.append((method, *args))
        if method == self.fail_on and sum(c[0] == method for c in self.calls) >= self.fail_after:
            raise RuntimeError(f"{self.name} cannot {method}: connection refused")

    def log_config(self, params):
        self._record("log_config", params)

    def log_metrics(self, values, step, wall_time):
        self._record("log_metrics", values, step, wall_time)

    def log_table(self, key, columns, rows, step):
        self._record("log_table", key, columns, rows, step)

    def log_summary(self, values, step):
        self._record("log_summary", values, step)

    def close(self, failed):
        self._record("close", failed)


def _failures(logs):
    return [e for e in logs if e["event"] == "tracker_failed"]


# ---- the recipe section -----------------------------------------------------------------------------------
def test_tensorboard_is_on_by_default_and_a_written_section_turns_its_tracker_on():
    assert TrackingConfig().enabled() == ["tensorboard"]
    config = TrackingConfig.model_validate({"wandb": {"mode": "offline"}, "mlflow": True,
                                            "trackio": {"enabled": False, "project": "p"},
                                            "tensorboard": {"enabled": False}})
    assert config.enabled() == ["wandb", "mlflow"]
    assert config.wandb.mode == "offline" and not config.trackio.enabled and config.trackio.project == "p"
    assert TrackingConfig.model_validate({"wandb": False}).enabled() == ["tensorboard"]


@pytest.mark.parametrize("overrides,message", [
    ({"tracking.wandb.modes": "offline"}, "tracking.wandb.modes: unknown key"),
    ({"tracking.wandb.mode": "disabled"}, "tracking.wandb.mode: Input should be 'online' or 'offline'"),
    ({"tracking.comet": {}}, "tracking.comet: unknown key"),
    ({"tracking.completions_per_eval": -1}, "tracking.completions_per_eval: Input should be greater than or equal to 0"),
])
def test_bad_tracking_sections_are_named(overrides, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(TINY, {"model": str(SMOLLM2_DIR)} | overrides)
    assert message in str(err.value)


def test_a_recipe_carries_its_tracking_section():
    recipe = load_recipe(TINY, {"model": str(SMOLLM2_DIR), "tracking.mlflow.experiment": "ablation",
                                "tracking.wandb": {"mode": "offline", "tags": ["lag2"]}})
    assert recipe.tracking.enabled() == ["tensorboard", "wandb", "mlflow"]
    assert recipe.tracking.mlflow.experiment == "ablation" and recipe.tracking.wandb.tags == ["lag2"]
    assert "tracking   tensorboard, wandb, mlflow" in describe(recipe).splitlines()  # gyre run --dry-run


# ---- what trackers are given --------------------------------------------------------------------------------
def test_the_recipe_is_flattened_to_dotted_keys():
    assert flatten({"learner": {"engine": {"lr": 1e-3}, "resume": "auto"}, "faults": {}, "eval": {"sets": ["a"]}}) == {
        "learner.engine.lr": 1e-3, "learner.resume": "auto", "faults": {}, "eval.sets": ["a"]}


def test_a_row_gives_its_finite_numbers_nested_ones_by_slash_and_no_x_axis_keys():
    row = {"step": 3, "version": 3, "time": 1.5e9, "loss": 0.25, "eval": "periodic", "checkpoint_committed": True,
           "rollout_versions": [3, 2], "rollout_reward_means": {"char_fraction": 0.5}, "grad_norm": float("nan"),
           "kl": None, "heldout_pass@4": 1}
    assert metric_values(row) == {"loss": 0.25, "checkpoint_committed": 1.0,
                                  "rollout_reward_means/char_fraction": 0.5, "heldout_pass@4": 1.0}


def test_the_completions_table_puts_greedy_ones_first_and_keeps_a_handful():
    completions = [{"set": "a", "index": i, "greedy": i % 2 == 0, "prompt": f"p{i}", "completion": f"c{i}",
                    "reward": i / 10, "answer": None, "versions": [1]} for i in range(6)]
    columns, rows = completion_table(completions, 4)
    assert columns == ["set", "index", "greedy", "prompt", "completion", "answer", "reward"]
    assert [r[1] for r in rows] == [0, 2, 4, 1] and rows[0] == ["a", 0, True, "p0", "c0", None, 0.0]
    text = markdown_table(["prompt", "completion"], [["1 | 2", "a\nb"]])
    assert text.splitlines() == ["| prompt | completion |", "|---|---|", "| 1 \\| 2 | a<br>b |"]


# ---- the fan-out --------------------------------------------------------------------------------------------
def _open(tmp_path, trackers: dict, **sections):
    config = TrackingConfig.model_validate(sections)
    return open_trackers(config, tmp_path, "t", {"learner": {"num_steps": 3}}, backends=trackers)


def test_every_enabled_tracker_gets_the_recipe_each_row_the_eval_table_and_the_summary(tmp_path):
    made = {}

    def backend(name):
        return lambda config, ctx: made.setdefault(name, Recording(config, ctx, name=name))

    trackers = _open(tmp_path, {n: backend(n) for n in ("tensorboard", "mlflow")}, mlflow={})
    writer = MetricsWriter(tmp_path / "metrics.jsonl", trackers)
    writer.write({"step": 1, "time": 10.0, "loss": 0.5, "version": 1})
    writer.write({"step": 0, "time": 11.0, "eval": "before", "heldout_accuracy": 0.25, "version": 0},
                 completions=[{"prompt": "1+1", "completion": "2", "reward": 1.0, "greedy": True}])
    writer.close()
    trackers.log_summary({"final_version": 1, "replay": {"acked_groups_total": 2}, "rollout_stats": [{}]}, 1)
    trackers.close()
    trackers.close()  # a second close does nothing
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 0]
    for name in ("tensorboard", "mlflow"):
        calls = made[name].calls
        assert calls == [
            ("log_config", {"learner.num_steps": 3}),
            ("log_metrics", {"loss": 0.5}, 1, 10.0),
            ("log_metrics", {"heldout_accuracy": 0.25}, 0, 11.0),
            ("log_table", "eval/completions", ["set", "index", "greedy", "prompt", "completion", "answer", "reward"],
             [[None, None, True, "1+1", "2", None, 1.0]], 0),
            ("log_summary", {"final_version": 1, "replay.acked_groups_total": 2}, 1),
            ("close", False)], name
    assert made["mlflow"].ctx.params == {"learner.num_steps": 3} and made["mlflow"].ctx.run_name == "t"


def test_a_tracker_whose_start_raises_is_reported_once_and_the_others_go_on(tmp_path):
    def refuse(config, ctx):
        raise PermissionError("wandb: 401 Unauthorized: bad API key")

    good = Recording(name="tensorboard")
    with capture_logs() as logs:
        trackers = _open(tmp_path, {"tensorboard": lambda c, x: good, "wandb": refuse}, wandb={})
        described = trackers.describe()
        trackers.log_row({"step": 1, "loss": 1.0})
        trackers.close()
    assert [(e["tracker"], e["during"], e["log_level"]) for e in _failures(logs)] == [("wandb", "start", "warning")]
    assert "401 Unauthorized" in _failures(logs)[0]["error"] and "PermissionError" in _failures(logs)[0]["error"]
    assert ("log_metrics", {"loss": 1.0}, 1, None) in good.calls and good.calls[-1] == ("close", False)
    assert trackers.failed == {"wandb": "PermissionError: wandb: 401 Unauthorized: bad API key"}
    assert described == ("tracking: tensorboard → /tensorboard; "
                                   "wandb OFF (PermissionError: wandb: 401 Unauthorized: bad API key)")


def test_a_tracker_that_fails_a_write_warns_once_is_closed_as_failed_and_gets_nothing_more(tmp_path):
    flaky = Recording(name="mlflow", fail_on="log_metrics", fail_after=2)
    good = Recording(name="tensorboard")
    with capture_logs() as logs:
        trackers = _open(tmp_path, {"tensorboard": lambda c, x: good, "mlflow": lambda c, x: flaky}, mlflow={})
        for step in range(1, 5):
            trackers.log_row({"step": step, "loss": 1.0 / step})
        trackers.log_completions([{"prompt": "p", "greedy": True}], 4)
        trackers.close()
    assert [(e["tracker"], e["during"]) for e in _failures(logs)] == [("mlflow", "log_metrics")]
    assert [c[0] for c in flaky.calls] == ["log_config", "log_metrics", "log_metrics", "close"]
    assert flaky.calls[-1] == ("close", True)
    assert [c[2] for c in good.calls if c[0] == "log_metrics"] == [1, 2, 3, 4]
    assert good.calls[-2][0] == "log_table" and good.calls[-1] == ("close", False)


def test_a_failed_run_closes_its_trackers_as_failed(tmp_path):
    good = Recording(name="tensorboard")
    trackers = _open(tmp_path, {"tensorboard": lambda c, x: good})
    trackers.close(failed=True)
    assert good.calls[-1] == ("close", True)


def test_each_backend_run_id_is_kept_in_the_run_directory_for_a_resumed_run(tmp_path):
    seen = []

    def backend(config, ctx):
        seen.append(ctx.resume_id)
        return Recording(name="wandb", resume_id=ctx.resume_id or "run-abc")

    _open(tmp_path, {"tensorboard": lambda c, x: Recording(name="tensorboard"), "wandb": backend}, wandb={}).close()
    assert json.loads((tmp_path / "tracking.json").read_text()) == {"wandb": "run-abc"}
    _open(tmp_path, {"tensorboard": lambda c, x: Recording(name="tensorboard"), "wandb": backend}, wandb={}).close()
    assert seen == [None, "run-abc"]


@pytest.mark.parametrize("module,section", [("wandb", "wandb"), ("mlflow", "mlflow"), ("trackio", "trackio")])
def test_a_missing_tracking_library_names_the_extra_and_the_run_goes_on(tmp_path, monkeypatch, module, section):
    monkeypatch.setitem(sys.modules, module, None)  # `import <module>` raises ImportError
    if module == "mlflow":
        monkeypatch.setitem(sys.modules, "mlflow.entities", None)
        monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with capture_logs() as logs:
        trackers = open_trackers(TrackingConfig.model_validate({section: {}, "tensorboard": False}), tmp_path, "t", {})
    assert trackers.active == [] and list(trackers.failed) == [section]
    assert TRACKING_EXTRA in trackers.failed[section] and "TrackerUnavailable" in trackers.failed[section]
    assert [e["tracker"] for e in _failures(logs)] == [section]
