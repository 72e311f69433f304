"""``time/rollout/*`` per learner step (``services.control.orchestration.rollout_time``, the controller's rows) and
``gyre report``'s ``time_breakdown.png``."""

import json
from types import SimpleNamespace

import pytest

from gyre.services.control.orchestration import controller
from gyre.services.control.outputs.report import LEARNER_TIME_KEYS, ROLLOUT_TIME_KEYS, plot_report
from gyre.services.control.orchestration.rollout_time import RolloutTimeDeltas, spread


def phases(generate, score=0.0, insert=0.0, weight_apply=0.0) -> dict:
    return {"generate_s": generate, "score_s": score, "insert_s": insert, "weight_apply_s": weight_apply}


def test_deltas_sum_over_rollouts_and_a_restarted_rollout_counts_from_zero():
    deltas = RolloutTimeDeltas()
    assert deltas.take({"rollout-0": phases(3.0, 1.0), "rollout-1": phases(2.0, insert=0.5)}) == {
        "time/rollout/generate_s": 5.0, "time/rollout/score_s": 1.0, "time/rollout/insert_s": 0.5,
        "time/rollout/weight_apply_s": 0.0}
    # rollout-1 restarted (its counters start again at 0); rollout-0 not described this round; an old worker
    # without the keys adds nothing
    got = deltas.take({"rollout-1": phases(1.5, weight_apply=0.25), "rollout-2": {"groups": 3}})
    assert got == {"time/rollout/generate_s": 1.5, "time/rollout/score_s": 0.0, "time/rollout/insert_s": 0.0,
                   "time/rollout/weight_apply_s": 0.25}
    assert deltas.take({"rollout-0": phases(4.0, 1.0)})["time/rollout/generate_s"] == 1.0  # kept its counters
    assert spread({"k": 3.0}, 2) == {"k": 1.5} and spread({"k": 3.0}, 0) == {}


class Remote:
    def __init__(self, fn) -> None:
        self.remote = fn


def test_controller_rows_carry_the_fleets_rollout_seconds_of_their_step(monkeypatch):
    """Two polls: the first brings steps 1 and 2 (sharing the rollout seconds since the start), the second
    step 3 (the seconds since the first poll)."""
    polls = iter([([{"step": 1}, {"step": 2}], False, None), ([{"step": 3}], True, None)])
    cumulative = iter([phases(4.0, 1.0), phases(7.0, 1.5)])
    rollout = SimpleNamespace(name="rollout-0", version=1, info=None)

    def tick():
        rollout.info = SimpleNamespace(tokens_per_s=1.0, stats=next(cumulative))

    handle = SimpleNamespace(describe=Remote(lambda: SimpleNamespace(version=0, running=True)),
                             progress=Remote(lambda cursor: next(polls)), version=Remote(lambda: 3))
    sup = SimpleNamespace(tick=tick, learner=SimpleNamespace(handle=handle, restarts=0), learner_generation=0,
                          rollouts=lambda: [rollout])
    written = []
    monkeypatch.setattr(controller.ray, "get", lambda ref, timeout=None: ref)
    recipe = SimpleNamespace(learner=SimpleNamespace(num_steps=3))
    final = controller._supervise_training(recipe, sup, SimpleNamespace(write=written.append),
                                           SimpleNamespace(update=lambda row: None), poll_s=0.0)
    assert final == 3
    assert [(r["step"], r["time/rollout/generate_s"], r["time/rollout/score_s"]) for r in written] == [
        (1, 2.0, 0.5), (2, 2.0, 0.5), (3, 3.0, 0.5)]


def learner_row(step: int, **parts) -> dict:
    row = {"step": step, "rollout_versions": [step - 1, step - 1]}
    row |= {key: parts.get(key.split("/")[-1].removesuffix("_s"), 0.1) for key in LEARNER_TIME_KEYS}
    row["time/learner/step_s"] = sum(row[k] for k in LEARNER_TIME_KEYS)
    return row | {key: 0.2 for key in ROLLOUT_TIME_KEYS}


@pytest.mark.parametrize("with_times", [True, False])
def test_report_draws_the_time_breakdown_and_skips_rows_without_the_keys(tmp_path, monkeypatch, with_times):
    from matplotlib.axes import Axes

    bars, bar = [], Axes.bar
    monkeypatch.setattr(Axes, "bar", lambda ax, x, h, **kw: bars.append((kw["label"], list(x), list(h)))
                        or bar(ax, x, h, **kw))
    rows = [{"step": 0, "heldout_accuracy": 0.25}, {"step": 1, "reward_mean": 0.5, "loss": 1.0}]  # an older run
    if with_times:
        rows += [learner_row(3, forward_backward=2.0), learner_row(2, wait_data=1.5),
                 {**learner_row(4), "time/rollout/generate_s": None}]  # a row missing a rollout value
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = plot_report(tmp_path / "metrics.jsonl", tmp_path / "report")
    png = tmp_path / "report" / "time_breakdown.png"
    assert png in paths and png.stat().st_size > 0
    if not with_times:
        assert bars == []
        return
    drawn = {label: (x, h) for label, x, h in bars}
    assert list(drawn) == ["wait_data", "forward_backward", "optimizer", "checkpoint", "publish_blocking", "other",
                           "generate", "score", "insert", "weight_apply"]
    assert drawn["wait_data"] == ([2, 3, 4], [1.5, 0.1, 0.1])  # every learner row, by step
    assert drawn["forward_backward"] == ([2, 3, 4], [0.1, 2.0, 0.1])
    assert drawn["generate"] == ([2, 3], [0.2, 0.2])  # step 4 lacks a rollout value: left out
