"""Hand-computed checks of learner.losses: every off-policy correction, the zero-staleness
reduction to on-policy policy gradient, KL estimators, entropy, clipped value loss, normalisers."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from pydantic import ValidationError

from gyre.learner.config import AlgorithmConfig
from gyre.learner.algo.losses import kl_penalty, loss_normaliser, policy_loss, row_token_scale, token_entropy, value_loss

LN = math.log


def _cfg(**kw) -> AlgorithmConfig:
    return AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.2, tis_cap=2.0, **kw)


def _known_case():
    """Two rows x three tokens (as in test_algorithms.py).

    r = current/proximal, rho = proximal/behaviour:
      row 0, A = +1:  t0 r 1.1 rho 1;  t1 r 1.5 rho 3;  t2 masked
      row 1, A = -2:  t0 r 0.5 rho 0.5; t1 r 1.0 rho 1; t2 r 2.0 rho 1.5
    PPO term -min(r A, clip(r) A) before any weight (clip range [0.8, 1.2]):
      row 0: t0 -1.1; t1 -1.2 (clipped)          row 1: t0 +1.6 (clipped); t1 +2.0; t2 +4.0
    """
    prox = torch.full((2, 3), LN(0.5))
    r = torch.tensor([[1.1, 1.5, 5.0], [0.5, 1.0, 2.0]])
    rho = torch.tensor([[1.0, 3.0, 1.0], [0.5, 1.0, 1.5]])
    logprobs = (prox + r.log()).requires_grad_(True)
    behaviour = prox - rho.log()
    behaviour[0, 2] = 0.0
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return logprobs, prox, behaviour, torch.tensor([1.0, -2.0]), mask


def _loss_and_grad(cfg, normaliser=None):
    logprobs, prox, behaviour, adv, mask = _known_case()
    loss, metrics = policy_loss(logprobs, prox, behaviour, adv, mask, cfg, normaliser)
    loss.backward()
    return loss.item(), metrics, logprobs.grad


def test_tis_seq_truncates_the_product_of_token_ratios():
    # row 0: prod rho = 1 * 3 = 3 -> min(3, 2) = 2 for both tokens: 2 * (-1.1 - 1.2) = -4.6
    # row 1: prod rho = 0.5 * 1 * 1.5 = 0.75 (kept): 0.75 * (1.6 + 2 + 4) = 5.7
    # loss = (-4.6 + 5.7) / 5 = 0.22; truncated tokens: row 0's two -> 2/5
    loss, m, grad = _loss_and_grad(_cfg(is_weight="tis_seq"))
    assert loss == pytest.approx(0.22, abs=1e-5)
    assert m["tis_clip_frac"] == pytest.approx(2 / 5) and m["mis_masked_frac"] == 0.0
    # unclipped tokens: dl/dlogp = -w A r / 5: row0 t0 -2 * 1.1 / 5 = -0.44; row1 t1 0.75 * 2 / 5 = 0.3;
    # row1 t2 0.75 * 2 * 2 / 5 = 0.6
    torch.testing.assert_close(grad, torch.tensor([[-0.44, 0.0, 0.0], [0.0, 0.3, 0.6]]), atol=1e-5, rtol=0)


def test_mis_token_drops_tokens_outside_the_band():
    # band [0.5, 2]: row0 t1 (rho 3) is dropped; rho 0.5 sits on the edge and is kept.
    # loss = (-1.1 + 1.6 + 2 + 4) / 5 = 1.3 (the dropped token still counts in the normaliser)
    loss, m, grad = _loss_and_grad(_cfg(is_weight="mis_token"))
    assert loss == pytest.approx(1.3, abs=1e-5)
    assert m["mis_masked_frac"] == pytest.approx(1 / 5) and m["tis_clip_frac"] == 0.0
    # weight 1: row0 t0 -1.1/5 = -0.22; row1 t1 2/5 = 0.4; row1 t2 2 * 2 / 5 = 0.8; dropped/clipped 0
    torch.testing.assert_close(grad, torch.tensor([[-0.22, 0.0, 0.0], [0.0, 0.4, 0.8]]), atol=1e-5, rtol=0)
    # band [0.6, 2] also drops row1 t0 (rho 0.5): loss = (-1.1 + 2 + 4) / 5 = 0.98
    loss, m, _ = _loss_and_grad(_cfg(is_weight="mis_token", mis_low=0.6))
    assert loss == pytest.approx(0.98, abs=1e-5) and m["mis_masked_frac"] == pytest.approx(2 / 5)


def test_mis_seq_drops_whole_trajectories():
    # row 0: prod rho 3 > 2 -> both tokens dropped; row 1: 0.75 in band -> kept with weight 1
    # loss = (1.6 + 2 + 4) / 5 = 1.52
    loss, m, grad = _loss_and_grad(_cfg(is_weight="mis_seq"))
    assert loss == pytest.approx(1.52, abs=1e-5)
    assert m["mis_masked_frac"] == pytest.approx(2 / 5)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.4, 0.8]]), atol=1e-5, rtol=0)


def test_no_weight_is_plain_decoupled_ppo():
    # loss = (-1.1 - 1.2 + 1.6 + 2 + 4) / 5 = 1.06 (equal to the TIS case by coincidence; gradients differ:)
    loss, m, grad = _loss_and_grad(_cfg(is_weight="none"))
    assert loss == pytest.approx(1.06, abs=1e-5)
    # row1 t2: -1 * -2 * 2 / 5 = 0.8 (TIS: 1.2, weighted by rho 1.5)
    torch.testing.assert_close(grad, torch.tensor([[-0.22, 0.0, 0.0], [0.0, 0.4, 0.8]]), atol=1e-5, rtol=0)
    assert m["tis_clip_frac"] == m["mis_masked_frac"] == 0.0


def test_ppo_against_behaviour_clips_current_over_behaviour():
    # ratio current/behaviour = r * rho: row0 (1.1, 4.5); row1 (0.25, 1.0, 3.0)
    # row0 A=+1: t0 min(1.1, 1.1) -> -1.1; t1 min(4.5, 1.2) = 1.2 (clipped) -> -1.2
    # row1 A=-2: t0 min(-0.5, -1.6) = -1.6 (clipped) -> 1.6; t1 -> 2; t2 min(-6, -2.4) = -6 -> 6
    # loss = (-1.1 - 1.2 + 1.6 + 2 + 6) / 5 = 1.46
    loss, m, grad = _loss_and_grad(_cfg(policy_ratio="behaviour", is_weight="none"))
    assert loss == pytest.approx(1.46, abs=1e-5)
    assert m["ppo_clip_frac"] == pytest.approx(2 / 5)
    # unclipped: -A * ratio / 5: row0 t0 -1.1/5 = -0.22; row1 t1 2 * 1 / 5 = 0.4; row1 t2 2 * 3 / 5 = 1.2
    torch.testing.assert_close(grad, torch.tensor([[-0.22, 0.0, 0.0], [0.0, 0.4, 1.2]]), atol=1e-5, rtol=0)


def test_config_rejects_double_correction_and_bad_band():
    with pytest.raises(ValueError, match="is_weight .'tis_token'. with policy_ratio 'behaviour'"):
        AlgorithmConfig(policy_ratio="behaviour")
    with pytest.raises(ValueError, match=r"mis_low \(1.0\) must be < mis_high \(1.0\)"):
        AlgorithmConfig(mis_low=1.0, mis_high=1.0)
    with pytest.raises(ValueError, match="mis_high\n  Input should be greater than or equal to 1"):
        AlgorithmConfig(mis_high=0.9)
    with pytest.raises(ValueError, match="advantage"):
        AlgorithmConfig(advantage="ppo")


ALL_CORRECTIONS = [("proximal", w) for w in ("tis_token", "tis_seq", "mis_token", "mis_seq", "none")] + [
    ("behaviour", w) for w in ("none", "mis_token", "mis_seq")
]


@pytest.mark.parametrize(("ratio", "weight"), ALL_CORRECTIONS)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_zero_staleness_every_correction_is_on_policy_pg(ratio, weight, per_token_adv):
    """behaviour == proximal == current: every ratio and weight is 1, nothing clips, truncates or is
    masked, so the loss is -sum(A)/N and the gradient -A/N: plain on-policy policy gradient."""
    torch.manual_seed(0)
    logprobs = (torch.randn(3, 4) - 2.0).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([0.5, -1.0, 2.0])
    if per_token_adv:
        adv = adv[:, None] + torch.tensor([0.0, 0.25, -0.5, 1.0])
    adv_bt = adv if per_token_adv else adv[:, None].expand(3, 4)
    same = logprobs.detach()
    cfg = _cfg(policy_ratio=ratio, is_weight=weight)
    loss, m = policy_loss(logprobs, same, same.clone(), adv, mask, cfg)
    expected = -(adv_bt * mask).sum() / 7  # 7 valid tokens
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert m["is_ratio_mean"] == m["is_ratio_max"] == 1.0
    assert m["tis_clip_frac"] == m["mis_masked_frac"] == m["ppo_clip_frac"] == m["approx_kl"] == 0.0
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -adv_bt * mask / 7)


def test_loss_normaliser_and_row_scale_of_each_aggregation():
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    assert loss_normaliser(AlgorithmConfig(), mask) == 8.0  # token-mean: 2 + 5 + 1 valid tokens
    assert row_token_scale(AlgorithmConfig(), mask) is None
    # Dr.GRPO (loss_agg_mode auto): the constant budget x 3 sequences, never the batch's longest response
    assert loss_normaliser(AlgorithmConfig(advantage="dr_grpo", max_response_tokens=10), mask) == 30.0
    assert loss_normaliser(AlgorithmConfig(advantage="dr_grpo", max_response_tokens=10,
                                           loss_agg_mode="token-mean"), mask) == 8.0
    sum_norm = AlgorithmConfig(loss_agg_mode="seq-mean-token-sum-norm", max_response_tokens=4)
    assert loss_normaliser(sum_norm, mask) == 12.0
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        assert loss_normaliser(AlgorithmConfig(loss_agg_mode=mode), mask) == 3.0
    torch.testing.assert_close(row_token_scale(AlgorithmConfig(loss_agg_mode="seq-mean-token-mean"), mask),
                               torch.tensor([1 / 2, 1 / 5, 1.0]))
    assert row_token_scale(AlgorithmConfig(loss_agg_mode="seq-mean-token-sum"), mask) is None
    assert loss_normaliser(AlgorithmConfig(), torch.zeros(2, 3, dtype=torch.bool)) == 1.0


def test_dr_grpo_needs_a_constant_and_loss_norm_names_its_successor():
    with pytest.raises(ValidationError, match="max_response_tokens is None"):
        AlgorithmConfig(advantage="dr_grpo")
    with pytest.raises(ValidationError, match="loss_norm .'token_sum'. is now loss_agg_mode"):
        AlgorithmConfig(loss_norm="token_sum")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_each_aggregation_weighs_tokens_as_documented(mode):
    """On-policy (ratio 1, weight 1) the loss is ``-sum_{i,t} c_it A_i``; each mode's ``c_it``, by hand."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, 2.0])
    lp = torch.zeros(2, 4, requires_grad=True)
    cfg = AlgorithmConfig(loss_agg_mode=mode, max_response_tokens=8)
    loss, _ = policy_loss(lp, lp.detach(), lp.detach(), adv, mask, cfg, normaliser=loss_normaliser(cfg, mask),
                          row_scale=row_token_scale(cfg, mask))
    expected = {
        "token-mean": -(2 * 1.0 + 4 * 2.0) / 6,  # every token 1/N
        "seq-mean-token-mean": -(1.0 + 2.0) / 2,  # every row's token mean, averaged over rows
        "seq-mean-token-sum": -(2 * 1.0 + 4 * 2.0) / 2,
        "seq-mean-token-sum-norm": -(2 * 1.0 + 4 * 2.0) / (2 * 8),
    }[mode]
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_dual_clip_bounds_a_negative_advantage_token_far_above_the_ratio():
    """Ye et al. 2020: with A < 0 and r = 5 the PPO-clip loss is -r A = 5 |A| (unbounded in r); dual-clip with
    c = 3 caps it at c |A| and its gradient is 0; positive advantages and r inside [1/c.., c] are untouched."""
    mask = torch.ones(1, 3, dtype=torch.bool)
    behaviour = torch.zeros(1, 3)
    logprobs = torch.tensor([[math.log(5.0), math.log(5.0), math.log(1.1)]], requires_grad=True)
    adv = torch.tensor([[-1.0, 2.0, -1.0]])
    plain = AlgorithmConfig(policy_ratio="behaviour", is_weight="none")
    dual = AlgorithmConfig(policy_ratio="behaviour", is_weight="none", dual_clip_c=3.0)
    loss_p, m_p = policy_loss(logprobs, behaviour, behaviour, adv, mask, plain, normaliser=1.0)
    loss_d, m_d = policy_loss(logprobs, behaviour, behaviour, adv, mask, dual, normaliser=1.0)
    # token 0: plain max(5, 1.2) = 5, dual min(5, 3) = 3; token 1: A > 0, clipped at 1.2 -> -2.4; token 2: 1.1
    assert loss_p.item() == pytest.approx(5.0 - 2.4 + 1.1, abs=1e-5)
    assert loss_d.item() == pytest.approx(3.0 - 2.4 + 1.1, abs=1e-5)
    assert m_p["dual_clip_frac"] == 0.0 and m_d["dual_clip_frac"] == pytest.approx(1 / 3)
    (grad,) = torch.autograd.grad(loss_d, logprobs)
    assert grad[0, 0] == 0.0 and grad[0, 1] == 0.0 and grad[0, 2] == pytest.approx(1.1, abs=1e-5)
    with pytest.raises(ValidationError):
        AlgorithmConfig(dual_clip_c=1.0)


def test_kl_estimators_k1_k2_k3_and_their_gradients():
    ref = torch.zeros(1, 4)
    # the 4th token is masked; its x = -200 would overflow exp(-x) to inf (and NaN the gradient)
    lp = torch.tensor([[LN(2), -LN(2), 0.0, -200.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True, False]])
    # k1 = x = (ln2, -ln2, 0), 0 off the mask
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "k1"), torch.tensor([[LN(2), -LN(2), 0.0, 0.0]]))
    # k3 = exp(-x) - 1 + x: x = ln2 -> 0.5 - 1 + 0.693147 = 0.193147; x = -ln2 -> 2 - 1 - 0.693147 = 0.306853; 0
    k3 = kl_penalty(lp, ref, mask, "k3")
    torch.testing.assert_close(k3, torch.tensor([[0.193147, 0.306853, 0.0, 0.0]]), atol=1e-6, rtol=0)
    # d k3 / dx = 1 - exp(-x): 0.5, -1, 0; masked token 0 (not NaN)
    k3.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.5, -1.0, 0.0, 0.0]]))
    # k2 = x^2 / 2: 0.240227, 0.240227, 0
    k2 = kl_penalty(lp, ref, mask, "k2")
    torch.testing.assert_close(k2, torch.tensor([[0.240227, 0.240227, 0.0, 0.0]]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="kl estimator 'k4'; expected 'k1', 'k2' or 'k3'"):
        kl_penalty(lp, ref, mask, "k4")
    with pytest.raises(ValueError, match="mask has shape"):
        kl_penalty(lp, ref, mask[:, :2], "k1")


def test_token_entropy_hand_computed():
    # position 0: logits (0, ln3) -> p = (1/4, 3/4): H = 0.25 ln4 + 0.75 ln(4/3) = 0.346574 + 0.215762 = 0.562335
    # position 1: uniform -> ln2 = 0.693147; position 2 predicts nothing (last), position 1 of row 1 masked
    logits = torch.tensor([[[0.0, LN(3)], [0.0, 0.0], [5.0, 0.0]], [[0.0, LN(3)], [0.0, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[True, True], [True, False]])
    expected = torch.tensor([[0.562335, 0.693147], [0.562335, 0.0]])
    torch.testing.assert_close(token_entropy(logits, mask), expected, atol=1e-6, rtol=0)
    # temperature 2 on (0, ln9) is (0, ln3)
    hot = torch.tensor([[[0.0, LN(9)], [0.0, 0.0]]])
    one = torch.tensor([[True]])
    torch.testing.assert_close(token_entropy(hot, one, temperature=2.0), torch.tensor([[0.562335]]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="mask has shape"):
        token_entropy(logits, torch.ones(2, 3, dtype=torch.bool))


def test_clipped_value_loss_hand_computed():
    # clip 0.2; t3 is masked.
    # t0: V 0.9, V_old 0.8 (inside clip) -> 0.5 * (0.9 - 1.5)^2 = 0.18; grad (0.9 - 1.5) / 3 = -0.2
    # t1: V 0.1, V_old 0.5 -> V_clip 0.3: max((0.1)^2, (0.3)^2) = 0.09 -> 0.045, clipped branch: grad 0
    # t2: V 2.0, V_old 1.0 -> V_clip 1.2: max(0.81, 0.01) = 0.81 -> 0.405; grad (2 - 1.1) / 3 = 0.3
    # loss = (0.18 + 0.045 + 0.405) / 3 = 0.21
    values = torch.tensor([[0.9, 0.1, 2.0, 7.0]], requires_grad=True)
    old = torch.tensor([[0.8, 0.5, 1.0, 0.0]])
    returns = torch.tensor([[1.5, 0.0, 1.1, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, m = value_loss(values, old, returns, mask, clip=0.2, normaliser=3.0)
    assert loss.item() == pytest.approx(0.21, abs=1e-6)
    assert m == {"value_loss": pytest.approx(0.21), "value_clip_frac": pytest.approx(1 / 3), "valid_tokens": 3.0}
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[-0.2, 0.0, 0.3, 0.0]]))
    with pytest.raises(ValueError, match="returns has shape"):
        value_loss(values, old, returns[:, :2], mask, 0.2, 3.0)


def test_the_logged_value_loss_is_the_token_mean_under_every_aggregation():
    # Issue #39: 2 rows of 10 tokens with loss 1 per token (|V - R| = sqrt 2) under seq-mean-token-mean (row scale
    # 1/10, normaliser B = 2): the loss is 1.0 and so is what is logged. The engine used to log
    # loss * normaliser / valid tokens = 1.0 * 2 / 20 = 0.1.
    values, old = torch.full((2, 10), 2 ** 0.5), torch.full((2, 10), 2 ** 0.5)
    mask = torch.ones(2, 10, dtype=torch.bool)
    cfg = AlgorithmConfig(loss_agg_mode="seq-mean-token-mean")
    loss, m = value_loss(values, old, torch.zeros(2, 10), mask, clip=0.2, normaliser=2.0,
                         row_scale=row_token_scale(cfg, mask))
    assert loss.item() == pytest.approx(1.0) and m["value_loss"] == pytest.approx(1.0)
    # token-mean over the same tokens (normaliser 20, no row scale): the same token mean
    assert value_loss(values, old, torch.zeros(2, 10), mask, 0.2, 20.0)[1]["value_loss"] == pytest.approx(1.0)


def test_every_listed_correction_is_a_valid_config():
    # the zero-staleness test covers each accepted (policy_ratio, is_weight) pair
    accepted = []
    weights = ("tis_token", "tis_seq", "mis_token", "mis_seq", "none")
    for ratio, weight in itertools.product(("proximal", "behaviour"), weights):
        try:
            AlgorithmConfig(policy_ratio=ratio, is_weight=weight)
            accepted.append((ratio, weight))
        except ValueError:
            pass
    assert sorted(accepted) == sorted(ALL_CORRECTIONS)
