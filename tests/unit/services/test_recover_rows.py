"""``services.control.outputs.report.recover_rows``: a new driver writes the rows of steps that an earlier learner finished
after its driver was killed (the learner's own copy, ``learner_rows.jsonl``), and only those."""

import json

import pytest

from gyre.services.common.run_files import LEARNER_ROWS
from gyre.services.control.outputs.report import MetricsWriter, read_metrics, recover_rows


def _rows(path, rows, torn=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + torn)


def test_steps_after_the_last_written_row_up_to_the_learner_version_are_written_once(tmp_path):
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    metrics.write({"step": 1, "loss": 0.5, "rollout_tokens_per_s": 9.0})
    metrics.write({"step": 1, "eval": "periodic", "heldout_accuracy": 0.1})  # not a training row
    # the killed driver's learner trained 2 and 3; a restarted one resumed from 2, re-trained 3 and trained 4
    _rows(tmp_path / LEARNER_ROWS, [{"step": s, "loss": l} for s, l in
                                    ((1, 0.5), (2, 0.4), (3, 0.3), (3, 0.25), (4, 0.2))], torn='{"step": 5, "lo')
    assert recover_rows(tmp_path, metrics, learner_version=3) == [2, 3]  # 4: the resumed learner's own, later
    metrics.close()
    train = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [(r["step"], r["loss"], r.get("recovered")) for r in train] == [(1, 0.5, None), (2, 0.4, True),
                                                                           (3, 0.25, True)]


def test_nothing_to_recover_without_the_learner_copy_or_past_the_learner_version(tmp_path):
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    assert recover_rows(tmp_path, metrics, learner_version=5) == []
    _rows(tmp_path / LEARNER_ROWS, [{"step": 1, "loss": 0.5}])
    assert recover_rows(tmp_path, metrics, learner_version=0) == []  # a cold start: nothing trained yet


def test_a_broken_line_before_the_last_is_an_error_naming_it(tmp_path):
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    (tmp_path / LEARNER_ROWS).write_text('{"step": 1, "loss": 0.5}\nnot json\n{"step": 2, "loss": 0.4}\n')
    with pytest.raises(ValueError, match=f"{LEARNER_ROWS}:2 is not JSON"):
        recover_rows(tmp_path, metrics, learner_version=2)


def test_learner_step_summary_takes_medians_of_the_training_rows():
    from gyre.services.control.outputs.report import learner_step_summary

    rows = [{"step": 0, "heldout_accuracy": 0.1},  # an eval row: not a training step
            {"step": 1, "step_time_s": 30.0, "time/learner/forward_backward_s": 25.0, "tokens_per_s": 100.0},
            {"step": 2, "step_time_s": 8.0, "time/learner/forward_backward_s": 6.0, "tokens_per_s": 400.0},
            {"step": 3, "step_time_s": 9.0, "time/learner/forward_backward_s": 7.0, "tokens_per_s": 380.0}]
    assert learner_step_summary(rows) == {"learner_steps": 3.0, "learner_step_time_s_median": 9.0,
                                          "learner_forward_backward_s_median": 7.0,
                                          "learner_tokens_per_s_median": 380.0}
    assert learner_step_summary(rows[:1]) == {}
