"""Loss-spike checkpoints (``learner.checkpoint.spike``): the Hampel rule on a planted spike, the shortened interval and its
hold, the detector's checkpoint state, and the learner loop saving earlier than ``save_interval`` after a spike."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gyre.learner.checkpoint import store as ckpt
from gyre.learner.config import LearnerConfig
from gyre.learner.loop import LearnerLoop, LearnerLoopConfig
from gyre.learner.publisher import WeightPublisher
from gyre.learner.checkpoint.spike import SpikeDetector, SpikeSaveConfig, spike_threshold
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from tests.fakes import FakeReplay, group_table
from tests.tiny_model import SMOLLM2_DIR
from tests.unit.learner.test_learner_loop import FakeLearnerEngine

CALM = [0.50, 0.52, 0.48, 0.51, 0.49]
"""A loss that wanders by +-0.02: median 0.50, MAD 0.01, threshold at factor 3.5: 0.50 + 3.5 * 1.4826 * 0.01."""


def test_threshold_is_median_plus_factor_robust_std():
    assert spike_threshold(CALM, 3.5) == pytest.approx(0.50 + 3.5 * 1.4826 * 0.01)
    assert spike_threshold([-0.1, 0.1, 0.0], 2.0) == pytest.approx(2.0 * 1.4826 * 0.1)  # a signed loss


def test_planted_spike_shortens_the_interval_for_the_hold_then_it_returns():
    det = SpikeDetector(SpikeSaveConfig(enabled=True, window=5, hold_steps=3, interval_divisor=2))
    rows = [{"loss": x, "grad_norm": 1.0 + x} for x in CALM]
    assert [det.observe(s, r) for s, r in enumerate(rows, 1)] == [{"loss_spike": 0.0, "loss_spikes": 0.0}] * 5
    assert [det.interval(s, 10) for s in range(1, 6)] == [10] * 5
    assert det.observe(6, {"loss": 0.60, "grad_norm": 1.5}) == {"loss_spike": 1.0, "loss_spikes": 1.0}
    assert [det.interval(s, 10) for s in range(6, 11)] == [5, 5, 5, 10, 10]  # steps 6, 7, 8 held
    assert det.interval(7, 1) == 1  # never below 1
    for s in (7, 8, 9):
        assert det.observe(s, {"loss": 0.5, "grad_norm": 1.5})["loss_spike"] == 0.0
    assert det.observe(10, {"loss": 0.5, "grad_norm": 9.0})["loss_spikes"] == 2.0  # grad norm alone counts
    assert [det.interval(s, 10) for s in (10, 12, 13)] == [5, 5, 10]


def test_nothing_spikes_before_the_window_fills_nor_on_a_fall_nor_on_nan():
    det = SpikeDetector(SpikeSaveConfig(enabled=True, window=5, metrics=["loss"]))
    assert det.observe(1, {"loss": 100.0})["loss_spike"] == 0.0  # no history yet
    for s, x in enumerate(CALM[:4], 2):
        det.observe(s, {"loss": x})
    assert det.observe(6, {"loss": -50.0})["loss_spike"] == 0.0  # a falling loss is no alarm
    assert det.observe(7, {"loss": float("nan")})["loss_spike"] == 0.0 and det.spikes == 0
    assert list(det.history["loss"]) == [0.50, 0.52, 0.48, 0.51, -50.0]  # NaN skipped, not stored


def test_disabled_detector_does_nothing():
    det = SpikeDetector(SpikeSaveConfig())
    assert det.observe(1, {"loss": 1e9}) == {} and det.interval(1, 10) == 10 and det.state_dict() == {}


@pytest.mark.parametrize("kw", [dict(window=2), dict(factor=0), dict(interval_divisor=1), dict(hold_steps=0),
                                dict(metrics=[]), dict(metrics=["reward"]), dict(windw=5)])
def test_bad_spike_config_is_refused(kw):
    with pytest.raises(ValidationError, match=next(iter(kw))):
        SpikeSaveConfig(**kw)


def test_detector_state_round_trips():
    det = SpikeDetector(SpikeSaveConfig(enabled=True, window=5, hold_steps=4))
    for s, x in enumerate(CALM + [3.0], 1):
        det.observe(s, {"loss": x, "grad_norm": x / 3})
    again = SpikeDetector(det.config)
    again.load_state_dict(det.state_dict())
    assert again.state_dict() == det.state_dict() and (again.hold_until, again.spikes) == (9, 1)
    assert again.observe(7, {"loss": 4.0}) == det.observe(7, {"loss": 4.0})
    fresh = SpikeDetector(det.config)
    fresh.load_state_dict({})  # a checkpoint without it
    assert fresh.spikes == 0 and fresh.hold_until == -1


# ---- the learner loop -------------------------------------------------------------------------
class SpikingEngine(FakeLearnerEngine):
    """Reports ``losses[step - 1]`` as each step's loss and keeps every save's ``spike_save`` state."""

    def __init__(self, losses: list[float]) -> None:
        super().__init__()
        self.losses, self.spike_states = losses, []

    def train_step(self, batch):
        row = super().train_step(batch)
        return row | {"loss": self.losses[self.step - 1]}

    def save_checkpoint(self, request):
        self.spike_states.append(dict(request.spike_save))
        return super().save_checkpoint(request)


def spiking_loop(losses: list[float], **spike) -> LearnerLoop:
    buf = TrajectoryBuffer(ReplayConfig(max_staleness=100))
    for i in range(2 * len(losses)):
        buf.insert(group_table(i, rewards=[0.0, 1.0, 1.0, 0.0]))
    cfg = LearnerLoopConfig(engine=LearnerConfig(model=str(SMOLLM2_DIR)), groups_per_step=2, save_interval=10,
                            spike_save=SpikeSaveConfig(**spike))
    return LearnerLoop(cfg, SpikingEngine(losses), FakeReplay(buf), WeightPublisher(), pad_token_id=0,
                       checkpoint_dir=Path("/ckpt"))


LOSSES = CALM + [5.0] + [0.5] * 6
"""A planted spike at step 6 of 12."""


def test_a_loss_spike_makes_the_loop_checkpoint_before_save_interval():
    loop = spiking_loop(LOSSES, enabled=True, window=5, interval_divisor=5, hold_steps=2, metrics=["loss"])
    rows = [loop.step() for _ in LOSSES]
    assert [s[0] for s in loop.engine.saves] == [6, 10]  # every 2 steps during steps 6-7, then every 10
    assert [r["loss_spike"] for r in rows] == [0.0] * 5 + [1.0] + [0.0] * 6
    assert rows[-1]["loss_spikes"] == 1.0 and rows[5]["checkpoint_committed"] == 1.0
    assert loop.engine.spike_states[0]["hold_until"] == 7 and loop.engine.spike_states[0]["spikes"] == 1


def test_without_spike_save_the_same_losses_checkpoint_at_save_interval_only():
    loop = spiking_loop(LOSSES)
    rows = [loop.step() for _ in LOSSES]
    assert [s[0] for s in loop.engine.saves] == [10] and "loss_spike" not in rows[5]
    assert loop.engine.spike_states == [{}]


def test_resume_restores_the_detector_from_the_checkpoint(tmp_path):
    state = {"history": {"loss": [0.5, 0.6, 0.4]}, "hold_until": 12, "spikes": 3}
    tmp = ckpt.temp_path(tmp_path, 10)
    tmp.mkdir()
    ckpt.commit(tmp, ckpt.checkpoint_path(tmp_path, 10), ckpt.CheckpointMetadata(step=10, policy_version=10,
                                                                                 spike_save=state))
    loop = spiking_loop([0.5] * 3, enabled=True, window=3, metrics=["loss"])
    loop.checkpoint_dir = tmp_path
    assert loop.resume() == tmp_path / "global_step_10"
    assert loop.spikes.state_dict() == state and loop.save_interval_at(12) == 5 and loop.save_interval_at(13) == 10
