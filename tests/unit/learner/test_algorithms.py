"""Hand-computed checks of learner.algo (GRPO advantages, decoupled PPO + TIS loss) and of the
per-step metrics of learner.step_metrics (ESS, staleness histogram, explained variance, merging)."""

from __future__ import annotations

import math

import pytest
import torch

from gyre.learner.algo.advantages import grpo_advantages
from gyre.learner.algo.logprobs import token_logprobs
from gyre.learner.algo.losses import policy_loss
from gyre.learner.config import AlgorithmConfig
from gyre.learner.step_metrics import explained_variance, kish_ess_fraction, merge_metrics, staleness_histogram

CFG = AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.2, tis_cap=2.0, adv_eps=1e-6)
LN = math.log


def test_grpo_advantages_2x3_population_std():
    rewards = torch.tensor([[0.0, 0.0, 3.0], [1.0, 2.0, 3.0]])
    # group 0: mean 1, deviations (-1, -1, 2), population var (1 + 1 + 4) / 3 = 2, std sqrt(2)
    #   -> (-1/sqrt2, -1/sqrt2, 2/sqrt2) = (-0.70711, -0.70711, 1.41421)
    # group 1: mean 2, deviations (-1, 0, 1), population var 2/3, std 0.81650
    #   -> (-1.22474, 0, 1.22474)
    # (the sample std would give sqrt(3) and 1 instead: (-0.577, -0.577, 1.155) and (-1, 0, 1))
    expected = torch.tensor([[-0.70711, -0.70711, 1.41421], [-1.22474, 0.0, 1.22474]])
    torch.testing.assert_close(grpo_advantages(rewards, eps=1e-6), expected, atol=1e-4, rtol=0)


def test_grpo_equal_rewards_give_zero_advantage():
    adv = grpo_advantages(torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]), eps=1e-6)
    assert torch.equal(adv, torch.zeros(2, 4))


def test_grpo_single_sample_group_is_zero_not_nan():
    assert torch.equal(grpo_advantages(torch.tensor([[5.0]]), eps=1e-6), torch.zeros(1, 1))


def test_grpo_rejects_bad_input():
    with pytest.raises(ValueError, match="rewards must be"):
        grpo_advantages(torch.zeros(3), eps=1e-6)
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(torch.zeros(1, 2), eps=0.0)


def test_token_logprobs_shift_and_temperature():
    # V = 2. position 0: logits [0, ln 3] -> p = (1/4, 3/4); position 1: [ln 9, 0] -> p = (0.9, 0.1).
    logits = torch.tensor([[[0.0, LN(3)], [LN(9), 0.0], [0.0, 0.0]]])
    ids = torch.tensor([[1, 1, 0]])
    # index j scores ids[j + 1] under position j: ids[1] = 1 at pos 0 -> ln 0.75; ids[2] = 0 at pos 1 -> ln 0.9.
    torch.testing.assert_close(token_logprobs(logits, ids), torch.tensor([[LN(0.75), LN(0.9)]]))
    # temperature 2 on logits [0, ln 9] -> [0, ln 3] -> p = (1/4, 3/4) everywhere.
    hot = torch.tensor([[[0.0, LN(9)]] * 3])
    flat = torch.tensor([[1, 0, 1]])
    assert token_logprobs(hot.bfloat16(), flat, temperature=2.0).dtype == torch.float32
    torch.testing.assert_close(token_logprobs(hot, flat, temperature=2.0), torch.tensor([[LN(0.25), LN(0.75)]]))


def _known_case():
    """Two rows x three tokens; the numbers below are chosen so every branch is hit.

    row 0, A = +1:  (r = current/proximal, rho = proximal/behaviour, w = min(rho, 2))
      t0: r 1.1, rho 1   -> min(1.1, 1.1) = 1.1          -> l = -1.1 * 1   = -1.1
      t1: r 1.5, rho 3   -> min(1.5, 1.2) = 1.2 (clipped) -> l = -1.2 * 2   = -2.4 (TIS truncated 3 -> 2)
      t2: masked (behaviour is padding 0.0, r would be 5)
    row 1, A = -2:
      t0: r 0.5, rho 0.5 -> min(-1.0, 0.8 * -2 = -1.6) = -1.6 (clipped) -> l = 1.6 * 0.5 = 0.8
      t1: r 1.0, rho 1   -> -2                          -> l = 2 * 1     = 2.0
      t2: r 2.0, rho 1.5 -> min(-4, 1.2 * -2 = -2.4) = -4 (unclipped)   -> l = 4 * 1.5 = 6.0
    loss = (-1.1 - 2.4 + 0.8 + 2.0 + 6.0) / 5 valid tokens = 5.3 / 5 = 1.06
    """
    prox = torch.full((2, 3), LN(0.5))
    r = torch.tensor([[1.1, 1.5, 5.0], [0.5, 1.0, 2.0]])
    rho = torch.tensor([[1.0, 3.0, 1.0], [0.5, 1.0, 1.5]])
    logprobs = (prox + r.log()).requires_grad_(True)
    behaviour = prox - rho.log()
    behaviour[0, 2] = 0.0
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return logprobs, prox, behaviour, torch.tensor([1.0, -2.0]), mask


def test_policy_loss_known_numbers():
    logprobs, prox, behaviour, adv, mask = _known_case()
    loss, m = policy_loss(logprobs, prox, behaviour, adv, mask, CFG)
    assert loss.item() == pytest.approx(1.06, abs=1e-5)
    assert m["is_ratio_mean"] == pytest.approx((1 + 3 + 0.5 + 1 + 1.5) / 5, abs=1e-5)  # 1.4
    assert m["is_ratio_max"] == pytest.approx(3.0, abs=1e-5)
    assert m["tis_clip_frac"] == pytest.approx(1 / 5)  # only row0 t1 (rho 3 > C = 2)
    assert m["ppo_clip_frac"] == pytest.approx(2 / 5)  # row0 t1 and row1 t0
    # k3 = rho - 1 - ln rho: 0, 2 - ln3 = 0.901388, -0.5 + ln2 = 0.193147, 0, 0.5 - ln1.5 = 0.094535
    assert m["approx_kl"] == pytest.approx((0.901388 + 0.193147 + 0.094535) / 5, abs=1e-5)
    assert m["valid_tokens"] == 5.0


def test_policy_loss_gradient_is_zero_where_clipped_and_weighted_by_tis():
    logprobs, prox, behaviour, adv, mask = _known_case()
    loss, _ = policy_loss(logprobs, prox, behaviour, adv, mask, CFG)
    loss.backward()
    # unclipped token: dl/dlogp = -w * A * r / N (d r / d logp = r)
    #   row0 t0: -1 * 1 * 1.1 / 5 = -0.22; row1 t1: -1 * -2 * 1 / 5 = 0.4; row1 t2: -1.5 * -2 * 2 / 5 = 1.2
    # clipped tokens (row0 t1, row1 t0) and the masked token get 0.
    expected = torch.tensor([[-0.22, 0.0, 0.0], [0.0, 0.4, 1.2]])
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-5, rtol=0)


def test_on_policy_loss_is_minus_token_mean_advantage():
    torch.manual_seed(0)
    logprobs = (torch.randn(3, 4) - 2.0).requires_grad_(True)
    adv = torch.tensor([0.5, -1.0, 2.0])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    same = logprobs.detach()
    loss, m = policy_loss(logprobs, same, same, adv, mask, CFG)
    # r = 1 and w = 1 everywhere: loss = -(2 * 0.5 + 4 * -1 + 1 * 2) / 7 = 1 / 7
    assert loss.item() == pytest.approx(1 / 7, abs=1e-6)
    assert m["is_ratio_mean"] == m["is_ratio_max"] == 1.0
    assert m["tis_clip_frac"] == m["ppo_clip_frac"] == m["approx_kl"] == 0.0
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -adv[:, None] * mask / 7)


def test_gradient_accumulation_with_shared_normaliser_matches_full_batch():
    torch.manual_seed(0)
    logprobs = (torch.randn(4, 5) * 0.3 - 1.0).requires_grad_(True)
    prox = logprobs.detach() + 0.1 * torch.randn(4, 5)  # r != 1 so some tokens clip
    behaviour = prox + 0.5 * torch.randn(4, 5)  # rho spread so some tokens truncate
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    # unequal token counts per micro-batch: rows 0-1 have 2 + 5, rows 2-3 have 1 + 3
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    full, _ = policy_loss(logprobs, prox, behaviour, adv, mask, CFG)
    (full_grad,) = torch.autograd.grad(full, logprobs)

    def accumulate(normaliser):
        total = torch.zeros_like(logprobs)
        for rows in (slice(0, 2), slice(2, 4)):
            lp = logprobs[rows]
            part, _ = policy_loss(lp, prox[rows], behaviour[rows], adv[rows], mask[rows], CFG, normaliser)
            total[rows] += torch.autograd.grad(part, lp)[0]
        return total

    torch.testing.assert_close(accumulate(float(mask.sum())), full_grad)
    # per-micro-batch means (normaliser 7 and 4 instead of 11) would not match:
    assert not torch.allclose(accumulate(None), full_grad)


def test_policy_loss_validates_shapes():
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        policy_loss(x, x, torch.zeros(2, 4), torch.zeros(2), mask, CFG)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, x, torch.zeros(3), mask, CFG)
    with pytest.raises(ValueError, match="bool"):
        policy_loss(x, x, x, torch.zeros(2), mask.float(), CFG)
    with pytest.raises(ValueError, match="normaliser"):
        policy_loss(x, x, x, torch.zeros(2), mask, CFG, normaliser=0.0)


def test_kish_ess_fraction():
    # w = (1, 1, 2): (sum w)^2 / sum w^2 = 16 / 6 = 2.6667 effective of 3 -> 0.888889
    assert kish_ess_fraction(torch.tensor([1.0, 1.0, 2.0])) == pytest.approx(8 / 9)
    assert kish_ess_fraction(torch.full((5,), 0.7)) == pytest.approx(1.0)  # on-policy: all equal
    assert kish_ess_fraction(torch.tensor([0.0, 0.0, 5.0])) == pytest.approx(1 / 3)  # one carries all
    assert kish_ess_fraction(torch.zeros(0)) == 0.0
    with pytest.raises(ValueError, match="must be >= 0; got min -1.0"):
        kish_ess_fraction(torch.tensor([1.0, -1.0]))


def test_staleness_histogram_caps_the_last_bucket_and_counts_negative_lag_on_its_own():
    # lags 0, 1, 1, 3, 12, -1, -2 with max bucket 3: bucket 0 <- {0}, 1 <- {1, 1}, 2 <- {}, 3 <- {3, 12};
    # -1, -2 (a crashed learner's versions after a rewind) are not on-policy: counted apart, in no bucket
    hist = staleness_histogram(torch.tensor([0, 1, 1, 3, 12, -1, -2]), max_bucket=3)
    assert hist == {"staleness_hist_0": 1.0, "staleness_hist_1": 2.0, "staleness_hist_2": 0.0, "staleness_hist_3": 2.0,
                    "staleness_negative": 2.0}
    assert list(staleness_histogram(torch.tensor([0]))) == [*(f"staleness_hist_{k}" for k in range(9)),
                                                            "staleness_negative"]


def test_explained_variance():
    # R = (1, 2, 3), V = (1, 2, 2): R - V = (0, 0, 1), var 2/9; var R = 2/3 -> 1 - 1/3 = 0.666667
    mask = torch.tensor([[True, True, True, False]])
    ev = explained_variance(torch.tensor([[1.0, 2.0, 2.0, 50.0]]), torch.tensor([[1.0, 2.0, 3.0, 0.0]]), mask)
    assert ev == pytest.approx(2 / 3)
    assert math.isnan(explained_variance(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)))


def test_merge_metrics_token_weighted_and_max():
    parts = [
        {"ppo_clip_frac": 1.0, "is_ratio_max": 2.0, "entropy": 3.0, "valid_tokens": 1.0},
        {"ppo_clip_frac": 4.0, "is_ratio_max": 3.0, "valid_tokens": 3.0},
    ]
    # (1 * 1 + 4 * 3) / 4 = 3.25; max 3; entropy only in the first part -> its own value
    assert merge_metrics(parts) == {"ppo_clip_frac": 3.25, "is_ratio_max": 3.0, "entropy": 3.0}
