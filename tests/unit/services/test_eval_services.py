"""The controller's side of evaluation (``services.control.orchestration.evaluation``), the recipe's ``eval:`` section and
``gyre eval`` (``services.cli.standalone_eval``) with a scripted engine in place of vLLM."""

import io
import json
from types import SimpleNamespace

import pytest
from rich.console import Console

from gyre.rollout.evaluation import EvalConfig, EvalResult
from gyre.rollout.types import Sample
from gyre.services.cli import main as cli
from gyre.services.cli.standalone_eval import run_standalone
from gyre.services.control.orchestration.evaluation import PeriodicEval, eval_line, eval_table, first_due, record_eval, write_completions
from gyre.services.control.orchestration.progress import RunProgress
from gyre.services.control.recipe.schema import RecipeError, load_recipe
from gyre.services.control.outputs.report import REPORT_PANELS, expand_keys, panel_points, plot_report, read_metrics
from tests.tiny_model import SMOLLM2_DIR

TINY = "deploy/recipes/tiny-test.yaml"


def _result(version: int, acc: float = 0.5, k: int | None = 2) -> EvalResult:
    metrics = {"heldout_accuracy": acc, "heldout_correct": 1, "heldout_size": 2, "heldout_score_mean": acc,
               "version": version, "eval/basic_arithmetic/greedy_accuracy": acc, "eval/basic_arithmetic/size": 2,
               "eval/basic_arithmetic/reward_errors": 1}
    if k:
        metrics.update({f"heldout_mean@{k}": 0.25, f"heldout_pass@{k}": 0.75, f"eval/basic_arithmetic/mean@{k}": 0.25,
                        f"eval/basic_arithmetic/pass@{k}": 0.75})
    return EvalResult(metrics, [{"set": "basic_arithmetic", "index": 0, "completion": "7", "greedy": True}])


class Writer:
    def __init__(self) -> None:
        self.rows, self.completions = [], []

    def write(self, row, completions=None):
        self.rows.append(row)
        self.completions.append(completions)


# ---- the recipe's eval: section -------------------------------------------------------------------------
def test_old_eval_keys_are_aliases_and_the_budget_defaults_to_the_training_one():
    base = {"model": str(SMOLLM2_DIR)}
    tiny = load_recipe(TINY, base)  # tiny-test.yaml sets eval.max_new_tokens: 8 (training: 24)
    assert (tiny.eval.before, tiny.eval.after, tiny.eval.max_new_tokens) == (True, True, 8)
    old = load_recipe(TINY, base | {"eval": {}, "eval_before": False, "eval_after": False,
                                    "rollout.eval_max_new_tokens": 5})
    assert (old.eval.before, old.eval.after, old.eval.max_new_tokens) == (False, False, 5)
    assert load_recipe(TINY, base | {"eval": {}}).eval.max_new_tokens == 24  # = rollout.sampling.max_new_tokens
    assert "eval_max_new_tokens" not in load_recipe(TINY, base).rollout.model_dump()


@pytest.mark.parametrize("overrides, message", [
    ({"eval_before": False, "eval.before": True}, "eval_before is the old name of eval.before: set only eval.before"),
    ({"rollout.eval_max_new_tokens": 4}, "rollout.eval_max_new_tokens is the old name of eval.max_new_tokens"),
    ({"eval.sets": ["chain_sum"]}, "eval.sets ['chain_sum'] are not held-out sets of the task; expected some of "
                                   "['basic_arithmetic']"),
    ({"eval.k": 4}, "eval.k: unknown key"),
    ({"eval.n_samples": -1}, "eval.n_samples: Input should be greater than or equal to 0"),
])
def test_bad_eval_sections_are_named(overrides, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(TINY, {"model": str(SMOLLM2_DIR)} | overrides)
    assert message in str(err.value)


# ---- rows, files, the progress line, plots --------------------------------------------------------------
def test_an_evaluation_is_one_metrics_row_and_one_completions_file(tmp_path):
    writer = Writer()
    row = record_eval(_result(4), tmp_path, writer, "periodic")
    assert writer.rows == [row] and row["step"] == 4 and row["eval"] == "periodic" and "loss" not in row
    assert writer.completions == [_result(4).completions]  # for the experiment trackers' table
    lines = (tmp_path / "eval" / "step_4.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == _result(4).completions
    write_completions(tmp_path, 4, [{"a": 1}, {"a": 2}])  # the same version again replaces the file
    assert (tmp_path / "eval" / "step_4.jsonl").read_text() == '{"a": 1}\n{"a": 2}\n'
    assert not list((tmp_path / "eval").glob("*.tmp"))
    assert eval_line(_result(4).metrics) == "eval@4 greedy 0.500 mean@2 0.250 pass@2 0.750"
    assert eval_line(_result(0, k=None).metrics) == "eval@0 greedy 0.500"


def test_the_table_has_a_row_per_set_and_one_for_all():
    console = Console(file=io.StringIO(), width=200)
    console.print(eval_table(_result(4).metrics, "t"))
    text = console.file.getvalue()
    assert "mean@2" in text and "pass@2" in text
    set_row = next(line for line in text.splitlines() if "basic_arithmetic" in line)
    assert [c.strip() for c in set_row.strip("│ ").split("│")] == ["basic_arithmetic", "2", "0.500", "0.250", "0.750", "1"]
    assert any(line.split("│")[1].strip() == "all" for line in text.splitlines() if "│" in line)


def test_the_progress_line_shows_the_newest_evaluation():
    with RunProgress(Console(file=io.StringIO(), width=300), 10) as progress:
        progress.update({"step": 1, "reward_mean": 0.25})
        progress.show_eval("eval@2 greedy 0.500")
        progress.update({"step": 3, "reward_mean": 0.5})
        info = progress._progress.tasks[0].fields["info"]
    assert info.startswith("reward 0.500") and info.endswith("| eval@2 greedy 0.500")


def test_report_plots_every_eval_set_and_pass_at_k(tmp_path):
    rows = [{"step": 3, "heldout_accuracy": 0.5, "eval/a/greedy_accuracy": 0.5, "eval/b/pass@4": 1.0},
            {"step": 1, "reward_mean": 0.2, "loss": 1.0}, {"step": 0, "heldout_accuracy": 0.25, "heldout_pass@4": 0.5}]
    assert expand_keys(["heldout_accuracy", "heldout_pass@*", "eval/*/greedy_accuracy", "eval/*/pass@*"], rows) == [
        "heldout_accuracy", "heldout_pass@4", "eval/a/greedy_accuracy", "eval/b/pass@4"]
    assert panel_points(REPORT_PANELS["accuracy"][1], rows) == {
        "heldout_accuracy": [(0, 0.25), (3, 0.5)], "heldout_pass@4": [(0, 0.5)], "eval/a/greedy_accuracy": [(3, 0.5)],
        "eval/b/pass@4": [(3, 1.0)]}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = plot_report(tmp_path / "metrics.jsonl", tmp_path / "report")
    assert (tmp_path / "report" / "accuracy.png") in paths


# ---- periodic evaluations -------------------------------------------------------------------------------
class Handle:
    def __init__(self, calls):
        self.evaluate = SimpleNamespace(remote=lambda cfg, due, wait_s: calls.append((cfg, due)) or f"ref{due}")


class Sup:
    def __init__(self) -> None:
        self.calls, self.running = [], True

    def running_rollouts(self):
        return [SimpleNamespace(name="rollout-0", handle=Handle(self.calls))] if self.running else []


class Refs:
    """``ray.wait`` / ``ray.get`` over refs the test resolves: ``outcome[ref]`` is a result or an exception."""

    def __init__(self) -> None:
        self.outcome = {}

    def wait(self, refs, timeout):
        return [r for r in refs if r in self.outcome], [r for r in refs if r not in self.outcome]

    def get(self, ref, timeout):
        if isinstance(self.outcome[ref], Exception):
            raise self.outcome[ref]
        return self.outcome[ref]


def test_periodic_evaluations_run_at_multiples_below_the_last_step_one_at_a_time(tmp_path):
    sup, refs, writer = Sup(), Refs(), Writer()
    evals = PeriodicEval(EvalConfig(every_steps=2, n_samples=2), 8, 0, tmp_path, writer, wait=refs.wait, get=refs.get)
    evals.poll(sup, 1)
    assert sup.calls == []
    evals.poll(sup, 2)
    assert [due for _, due in sup.calls] == [2] and sup.calls[0][0]["n_samples"] == 2
    evals.poll(sup, 5)  # 4 was crossed while the evaluation of 2 still runs: skipped, not queued
    assert evals.skipped == [4] and len(sup.calls) == 1
    refs.outcome["ref2"] = _result(3)  # it evaluated the version the rollout held then
    evals.poll(sup, 6)
    assert [r["step"] for r in writer.rows] == [3] and (tmp_path / "eval" / "step_3.jsonl").is_file()
    assert [due for _, due in sup.calls] == [2, 6]
    refs.outcome["ref6"] = _result(6)
    evals.poll(sup, 8)  # 8 = num_steps: the final evaluation is eval.after's
    assert [due for _, due in sup.calls] == [2, 6] and [r["step"] for r in writer.rows] == [3, 6]


def test_a_failed_or_impossible_periodic_evaluation_never_stops_the_run(tmp_path):
    sup, refs, writer = Sup(), Refs(), Writer()
    evals = PeriodicEval(EvalConfig(every_steps=1), 10, 0, tmp_path, writer, wait=refs.wait, get=refs.get)
    evals.poll(sup, 1)
    refs.outcome["ref1"] = RuntimeError("The actor died unexpectedly before finishing this task.")
    evals.poll(sup, 1)
    assert evals.skipped == [1] and writer.rows == [] and evals.inflight is None
    sup.running = False  # rollout-0 is restarting
    evals.poll(sup, 2)
    assert evals.skipped == [1, 2] and [due for _, due in sup.calls] == [1]
    sup.running = True
    evals.poll(sup, 3)
    refs.outcome["ref3"] = _result(3)
    evals.drain()
    assert [r["step"] for r in writer.rows] == [3]


def test_a_resumed_run_evaluates_from_the_next_multiple_and_none_means_never():
    assert first_due(5, 0) == 5 and first_due(5, 7) == 10 and first_due(5, 10) == 15
    assert first_due(None, 3) is None and first_due(0, 3) is None


# ---- gyre eval ------------------------------------------------------------------------------------------
class FakeEngine:
    """A started engine that answers every prompt "7" (scripted; no vLLM)."""

    version = None

    async def generate_greedy(self, prompts, max_new_tokens):
        return [Sample([1], [-0.1], "stop", [0], [self.version], text="7") for _ in prompts]

    async def generate(self, prompt_ids, n, sampling, request_id, seed=None):
        return [Sample([1], [-0.1], "length", [0], [self.version], text="7") for _ in range(n)]

    async def shutdown(self):
        self.stopped = True


def test_gyre_eval_of_a_model_folder_prints_a_table_and_writes_the_files(tmp_path):
    engine = FakeEngine()

    async def start(config, version):
        engine.model, engine.version = config.model, version
        return engine

    console = Console(file=io.StringIO(), width=200)
    load = lambda folder: load_recipe(TINY, {"model": folder, "eval.n_samples": 3, "run_dir": str(tmp_path)})
    row = run_standalone(str(SMOLLM2_DIR), load, None, console, start_engine=start)
    out = tmp_path / "tiny-test" / "standalone-eval"
    assert engine.model == str(SMOLLM2_DIR.resolve()) and engine.stopped and row["step"] == 0
    assert read_metrics(out / "metrics.jsonl") == [row] and row["eval"] == "standalone"
    assert row["target"] == str(SMOLLM2_DIR.resolve()) and row["heldout_size"] == 8 and "heldout_pass@3" in row
    assert len((out / "eval" / "step_0.jsonl").read_text().splitlines()) == 8 * (1 + 3)
    assert "pass@3" in console.file.getvalue() and "step_0.jsonl" in console.file.getvalue()


def test_gyre_eval_refuses_what_it_cannot_evaluate(tmp_path, capsys):
    assert cli.main(["eval", str(tmp_path / "nope"), TINY]) == 2
    assert "does not exist or is not a directory" in capsys.readouterr().out
    assert cli.main(["eval", str(tmp_path), TINY]) == 2  # an empty folder
    assert "neither a Hugging Face model folder" in capsys.readouterr().out
    (tmp_path / "manifest.json").write_text("{}")
    assert cli.main(["eval", str(tmp_path), TINY]) == 2  # a broken checkpoint
    assert f"checkpoint {tmp_path}" in capsys.readouterr().out
    assert cli.main(["eval", str(SMOLLM2_DIR), TINY, "--set", "eval.sets=[nope]"]) == 2
    assert "eval.sets ['nope'] are not held-out sets" in capsys.readouterr().out


def test_gyre_eval_scores_a_reward_model_in_its_own_process(tmp_path, tiny_classifier):
    """No service runs for ``gyre eval``: the recipe's reward model is loaded in the process, so the held-out rows
    carry its score (without the local transport every row would be a ``reward_error``)."""
    from gyre.rollout.rewards import model as rm

    engine = FakeEngine()

    async def start(config, version):
        engine.version = version
        return engine

    load = lambda folder: load_recipe(TINY, {"model": folder, "run_dir": str(tmp_path), "task.reward":
                                             {"model": str(tiny_classifier)}})
    try:
        row = run_standalone(str(SMOLLM2_DIR), load, None, Console(file=io.StringIO()), start_engine=start)
    finally:
        rm.set_transport(None)
    lines = [json.loads(x) for x in (tmp_path / "tiny-test" / "standalone-eval" / "eval" / "step_0.jsonl").open()]
    assert row["eval/basic_arithmetic/reward_errors"] == 0
    assert len(lines) == 16 and all(x["reward_error"] == "" for x in lines), lines[0]  # greedy + 1 sample each
    assert len({x["reward"] for x in lines}) > 1  # the classifier's logits, one per prompt
