"""A driver re-attached to a learner that outlived the killed one writes the metrics rows of every step after the
last one ``metrics.jsonl`` holds (``services.control.orchestration.controller._supervise_training``), whether the learner is
still training or finished its steps while no driver watched."""

import json
from types import SimpleNamespace

import pytest

from gyre.services.control.orchestration import controller
from tests.fakes import FakeLearnerHandle


def supervise(learner: FakeLearnerHandle, written: int, num_steps: int, monkeypatch) -> tuple[int, list[int]]:
    """Run the re-attached driver's training loop against ``learner``; returns (final version, steps written)."""
    rows = []
    polls = iter(range(100))

    def tick():  # the learner trains on between polls (a still-running one finishes step 5 at the second poll)
        if next(polls) == 1 and learner.running:
            learner.finish(5, last=True)

    sup = SimpleNamespace(tick=tick, learner=SimpleNamespace(handle=learner, restarts=0), learner_generation=0,
                          rollouts=lambda: [])
    monkeypatch.setattr(controller.ray, "get", lambda ref, timeout=None: ref)
    final = controller._supervise_training(SimpleNamespace(learner=SimpleNamespace(num_steps=num_steps)), sup,
                                           SimpleNamespace(write=rows.append), SimpleNamespace(update=lambda r: None),
                                           written, poll_s=0.0)
    return final, [r["step"] for r in rows]


def test_steps_the_learner_finished_after_the_kill_are_written(tmp_path, monkeypatch):
    # the killed driver wrote steps 1-3; the detached learner went on to finish steps 4 and 5 (all of the run)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 0.1 * s}) + "\n" for s in (1, 2, 3)))
    learner = FakeLearnerHandle([1, 2, 3, 4, 5])
    assert supervise(learner, controller._last_step(metrics), 5, monkeypatch) == (5, [4, 5])
    assert learner.runs == []  # nothing left to train


@pytest.mark.parametrize("running", [True, False])
def test_a_learner_with_steps_left_resumes_after_the_written_rows(running, monkeypatch):
    # still running the killed driver's run (steps 4 done, 5 to come), or stopped at 4 (a new run(1) is issued)
    learner = FakeLearnerHandle([1, 2, 3, 4], running=running)
    final, steps = supervise(learner, 3, 5, monkeypatch)
    assert steps == ([4, 5] if running else [4]) and learner.runs == ([] if running else [1])
