"""Where a learner step's time goes (``learner.step_timer``, ``LearnerLoop.step``'s ``time/learner/*`` keys)."""

import time

import pytest

from gyre.learner import loop as learner_loop
from gyre.learner.step_timer import PHASES, PREFIX, StepTimer
from tests.fakes import FakeClock, FakeReplay
from tests.unit.learner.test_learner_loop import FakeLearnerEngine, filled_buffer, make_loop

SECONDS = {"wait_data": 7.0, "forward_backward": 5.0, "optimizer": 3.0, "checkpoint": 6.0, "publish_blocking": 4.0,
           "other": 2.0}
"""What each collaborator of the loop below spends on the fake clock, by the phase it belongs to."""


class TimedEngine(FakeLearnerEngine):
    """Spends ``SECONDS`` on ``clock``: forward/backward, then the optimizer (reported as ``optimizer_step_s``,
    as ``LearnerEngine`` does), gathering weights to publish, saving a checkpoint."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock

    def train_step(self, batch):
        metrics = super().train_step(batch)
        self.clock.advance(SECONDS["forward_backward"])
        self.clock.advance(SECONDS["optimizer"])
        return metrics | {"optimizer_step_s": SECONDS["optimizer"]}

    def capture_weights(self):
        self.clock.advance(SECONDS["publish_blocking"])
        return super().capture_weights()

    def save_checkpoint(self, request):
        self.clock.advance(SECONDS["checkpoint"])
        return super().save_checkpoint(request)


class SlowReplay(FakeReplay):
    def __init__(self, buffer, clock: FakeClock) -> None:
        super().__init__(buffer)
        self.clock = clock

    def sample(self, *args, **kw):
        self.clock.advance(SECONDS["wait_data"])
        return super().sample(*args, **kw)


def test_each_phase_lands_in_its_bucket_and_the_parts_sum_to_the_step(monkeypatch):
    clock = FakeClock(100.0)
    monkeypatch.setattr(time, "perf_counter", clock)
    build = learner_loop.build_train_batch

    def slow_build(*args, **kw):  # building the batch is none of the named phases: "other"
        clock.advance(SECONDS["other"])
        return build(*args, **kw)

    monkeypatch.setattr(learner_loop, "build_train_batch", slow_build)
    buf = filled_buffer()
    loop, _ = make_loop(buf, save_interval=1)
    loop.engine, loop.replay = TimedEngine(clock), SlowReplay(buf, clock)
    row = loop.step()
    assert {k: v for k, v in row.items() if k.startswith(PREFIX)} == {
        **{f"{PREFIX}{name}_s": s for name, s in SECONDS.items()}, f"{PREFIX}step_s": sum(SECONDS.values())}
    assert row["step_s"] == row[f"{PREFIX}step_s"] and row["sample_wait_s"] == SECONDS["wait_data"]
    assert row["publish_s"] == SECONDS["publish_blocking"] and row["checkpoint_s"] == SECONDS["checkpoint"]


def test_a_step_without_a_checkpoint_has_zero_checkpoint_time_and_still_sums_exactly():
    loop, _ = make_loop(filled_buffer(), save_interval=2)
    row = loop.step()  # real clock, no checkpoint due at step 1
    parts = [row[f"{PREFIX}{name}_s"] for name in (*PHASES, "other")]
    assert row[f"{PREFIX}checkpoint_s"] == 0.0 and min(parts) >= 0.0
    assert sum(parts) == pytest.approx(row[f"{PREFIX}step_s"], abs=1e-9)
    assert row[f"{PREFIX}step_s"] == row["step_s"]


def test_step_timer_moves_a_callees_share_and_refuses_unknown_phases(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    timer = StepTimer()
    with timer.phase("forward_backward"):
        clock.advance(2.0)
    timer.move("forward_backward", "optimizer", 5.0)  # more than the source holds: capped, nothing negative
    assert timer.seconds["forward_backward"] == 0.0 and timer.seconds["optimizer"] == 2.0
    with pytest.raises(KeyError, match="unknown learner step phase 'sleep'"):
        with timer.phase("sleep"):
            pass
    clock.advance(1.0)
    assert timer.row()[f"{PREFIX}other_s"] == 1.0
