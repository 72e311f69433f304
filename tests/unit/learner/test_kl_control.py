"""The adaptive KL controller (Ziegler et al. 2019, §2.2; verl's ``AdaptiveKLController``): its update against a
hand-computed sequence, its validation, and its checkpoint state."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest
from pydantic import ValidationError

from gyre.learner.checkpoint.store import CheckpointMetadata
from gyre.learner.config import AlgorithmConfig
from gyre.learner.algo.kl_control import KLControlConfig, KLController, check_horizon

ADAPTIVE = KLControlConfig(type="adaptive", target_kl=0.1, horizon=100)


def test_adaptive_update_follows_the_hand_computed_sequence():
    ctrl = KLController(0.1, ADAPTIVE)
    # (observed KL, trajectories) -> e = clip(KL / 0.1 - 1, -0.2, 0.2); beta *= 1 + e * n / 100
    steps = [(0.2, 10), (0.05, 10), (0.11, 10), (0.1, 10), (0.3, 50)]
    expected = [0.1 * 1.02, 0.1 * 1.02 * 0.98, 0.1 * 1.02 * 0.98 * 1.01, 0.1 * 1.02 * 0.98 * 1.01,
                0.1 * 1.02 * 0.98 * 1.01 * 1.1]
    got = [ctrl.update(kl, n) for kl, n in steps]
    assert got == pytest.approx(expected, rel=1e-12, abs=0)
    assert ctrl.value == got[-1] and ctrl.updates == 5


def test_adaptive_update_is_verls_float_arithmetic_exactly():
    """The same operations in the same order as verl's ``AdaptiveKLController.update`` (numpy clip), so a
    coefficient sequence matches a verl run's bit for bit."""
    ctrl, value = KLController(0.05, ADAPTIVE), 0.05
    for kl, n in [(0.0, 6), (0.013, 6), (0.37, 6), (0.0999, 64), (float(np.float32(0.12345)), 6)]:
        value *= 1 + np.clip(kl / ADAPTIVE.target_kl - 1, -0.2, 0.2) * n / ADAPTIVE.horizon
        assert ctrl.update(kl, n) == value


def test_fixed_controller_never_moves():
    ctrl = KLController(0.05, KLControlConfig())
    assert [ctrl.update(kl, 8) for kl in (0.0, 1.0, 100.0)] == [0.05, 0.05, 0.05] and ctrl.updates == 0


def test_non_finite_kl_skips_the_update():
    ctrl = KLController(0.1, ADAPTIVE)
    assert ctrl.update(float("nan"), 10) == 0.1 and ctrl.update(float("inf"), 10) == 0.1 and ctrl.updates == 0


@pytest.mark.parametrize("kw, match", [
    (dict(target_kl=0.0), "target_kl"),
    (dict(target_kl=-1.0), "target_kl"),
    (dict(horizon=0), "horizon"),
    (dict(type="pid"), "type"),
    (dict(targt_kl=0.1), "targt_kl"),
])
def test_bad_controller_config_is_refused_naming_the_key(kw, match):
    with pytest.raises(ValidationError, match=match):
        KLControlConfig(**kw)


def test_adaptive_without_a_reference_model_is_refused_naming_kl_coef():
    with pytest.raises(ValidationError, match=r"kl_ctrl.type 'adaptive' needs kl_coef > 0 .* got kl_coef 0.0"):
        AlgorithmConfig(kl_ctrl={"type": "adaptive"})
    with pytest.raises(ValueError, match="got kl_coef 0"):
        KLController(0, ADAPTIVE)
    algo = AlgorithmConfig(kl_coef=0.01, kl_ctrl={"type": "adaptive", "target_kl": 0.02, "horizon": 500})
    assert algo.kl_ctrl == KLControlConfig(type="adaptive", target_kl=0.02, horizon=500)
    assert AlgorithmConfig().kl_ctrl.type == "fixed"  # the default: today's constant kl_coef


def test_a_horizon_too_short_for_the_batch_is_refused():
    check_horizon(ADAPTIVE, 499)  # smallest multiplier 1 - 0.2 * 499 / 100 = 0.002 > 0: accepted
    with pytest.raises(ValueError, match=r"kl_ctrl.horizon \(100\) must be > 0.2 \* the trajectories per step \(500\)"):
        check_horizon(ADAPTIVE, 500)
    with pytest.raises(ValueError, match=r"horizon \(100\)"):
        KLController(0.1, ADAPTIVE).update(0.0, 600)  # multiplier 1 - 0.2 * 6 < 0
    check_horizon(KLControlConfig(horizon=1), 10_000)  # fixed: horizon unused


def test_state_round_trips_exactly_through_checkpoint_json():
    ctrl = KLController(0.1, ADAPTIVE)
    for kl in (0.2, 0.0371, 0.15, 0.099):
        ctrl.update(kl, 7)
    text = json.dumps(asdict(CheckpointMetadata(step=4, policy_version=4, kl_ctrl=ctrl.state_dict())))  # as commit
    meta = CheckpointMetadata.from_dict(json.loads(text))
    resumed = KLController(0.1, ADAPTIVE)
    resumed.load_state_dict(meta.kl_ctrl)
    assert resumed.value == ctrl.value and resumed.updates == 4  # == on floats: bit-identical
    assert resumed.update(0.3, 7) == ctrl.update(0.3, 7)


def test_checkpoints_without_the_state_or_from_another_controller_start_at_kl_coef():
    old = CheckpointMetadata.from_dict({"step": 3, "policy_version": 3})  # written before kl_ctrl existed
    assert old.kl_ctrl == {}
    ctrl = KLController(0.1, ADAPTIVE)
    ctrl.load_state_dict(old.kl_ctrl)
    assert ctrl.value == 0.1
    ctrl.load_state_dict({"type": "fixed", "kl_coef": 0.5, "updates": 0})  # a fixed run's: kl_coef stands
    assert ctrl.value == 0.1
    fixed = KLController(0.2, KLControlConfig())
    fixed.load_state_dict({"type": "adaptive", "kl_coef": 0.5, "updates": 9})  # fixed: always the configured value
    assert fixed.value == 0.2
    with pytest.raises(ValueError, match=r"kl_coef \(nan\)"):
        ctrl.load_state_dict({"type": "adaptive", "kl_coef": float("nan")})


def test_kl_in_the_reward_uses_the_controllers_current_value_not_kl_coef():
    import torch

    from gyre.learner.batch import build_train_batch
    from gyre.learner.step_start import step_targets
    from gyre.proto.trajectory import to_table
    from tests.unit.learner.test_overlong import PAD, _FakeLearner, _rows

    algo = AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0, kl_coef=0.1, kl_placement="reward",
                           kl_estimator="k1", kl_ctrl=ADAPTIVE)
    batch = build_train_batch(to_table(_rows()), PAD, 4, algo)
    learner = _FakeLearner(algo)
    learner.kl_ctrl.value = 0.3  # as after some adaptive updates
    first = batch.response_mask.float().argmax(dim=1)  # V = 0: the first token's advantage is the row's return
    advantages = step_targets(learner, batch).advantages[torch.arange(batch.batch_size), first]
    torch.testing.assert_close(advantages, batch.shaped_rewards - 0.3 * learner.kl(batch), atol=1e-5, rtol=0)
    assert not torch.allclose(advantages, batch.shaped_rewards - 0.1 * learner.kl(batch), atol=1e-3)
