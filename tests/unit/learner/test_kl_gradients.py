"""What each KL regulariser trains: for a 5-token softmax policy, the *exact* expectation over the sampled
token (a sum over the vocabulary weighted by the detached ``pi``, the on-policy sampling distribution) of the
gradient of each loss equals the autograd gradient of the closed-form KL that ``KL_LOSS_GRADIENT`` and the
docs claim (Tang & Munos 2025): ``k2`` -> ``KL(pi || pi_ref)``, ``k3`` -> ``KL(pi_ref || pi)``, ``k1`` -> 0; and
the KL in the reward (``kl_placement: reward``), through the real reward shaping, GAE, group baseline and
policy loss, -> ``beta * KL(pi || pi_ref)``."""

from __future__ import annotations

import itertools

import pytest
import torch

from gyre.learner.algo.advantages import gae, group_advantages, kl_shaped_rewards
from gyre.learner.config import KL_LOSS_GRADIENT, AlgorithmConfig
from gyre.learner.algo.losses import kl_penalty, policy_loss

THETA = torch.tensor([0.3, -1.2, 0.8, 0.0, -0.4])
"""Logits of the policy ``pi = softmax(THETA)`` (the leaf the gradients are taken of)."""
REF_LOGITS = torch.tensor([-0.5, 0.7, 0.1, 1.1, -0.9])
BETA = 0.3
FORWARD, REVERSE = "KL(pi || pi_ref)", "KL(pi_ref || pi)"


def _policy() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(theta leaf, log pi [V], log pi_ref [V])``."""
    theta = THETA.clone().requires_grad_(True)
    return theta, torch.log_softmax(theta, -1), torch.log_softmax(REF_LOGITS, -1)


def _kl_grad(which: str) -> torch.Tensor:
    """Autograd gradient w.r.t. ``theta`` of the closed-form KL between the two categoricals."""
    theta, logp, ref = _policy()
    if which == FORWARD:
        kl = (logp.exp() * (logp - ref)).sum()
    elif which == REVERSE:
        kl = (ref.exp() * (ref - logp)).sum()
    else:
        raise AssertionError(f"unknown KL {which!r}")
    return torch.autograd.grad(kl, theta)[0]


def test_the_two_kl_directions_have_different_nonzero_gradients_here():
    """The control: at this policy the claims are distinguishable (a swapped claim would fail below)."""
    fwd, rev = _kl_grad(FORWARD), _kl_grad(REVERSE)
    assert fwd.abs().max() > 0.1 and rev.abs().max() > 0.1
    assert (fwd - rev).abs().max() > 0.1


@pytest.mark.parametrize("estimator", sorted(KL_LOSS_GRADIENT))
def test_each_kl_loss_trains_the_kl_it_claims(estimator):
    theta, logp, ref = _policy()
    mask = torch.ones(1, len(THETA), dtype=torch.bool)
    per_token = kl_penalty(logp[None], ref[None], mask, estimator)[0]  # [V]: the loss when token a is sampled
    expected_loss = (logp.detach().exp() * per_token).sum()  # E_{a ~ pi}, the sampling distribution held fixed
    grad = torch.autograd.grad(expected_loss, theta)[0]
    claim = KL_LOSS_GRADIENT[estimator]
    want = torch.zeros_like(grad) if claim is None else _kl_grad(claim)
    torch.testing.assert_close(grad, want, atol=1e-6, rtol=1e-5,
                               msg=lambda m: f"{estimator} as a loss does not train {claim or 'nothing'}: {m}")


def test_k1_as_a_loss_is_refused_naming_the_alternatives():
    with pytest.raises(ValueError, match="zero expected gradient.*'k2'.*'k3'.*kl_placement 'reward'"):
        AlgorithmConfig(kl_coef=0.1, kl_estimator="k1")
    with pytest.raises(ValueError, match="kl_placement 'reward'.*got kl_estimator 'k3', expected 'k1'"):
        AlgorithmConfig(kl_coef=0.1, kl_placement="reward")
    assert AlgorithmConfig(kl_coef=0.1, kl_estimator="k1", kl_placement="reward").kl_placement == "reward"
    assert AlgorithmConfig().kl_estimator == "k3" and AlgorithmConfig().kl_placement == "loss"


def _reward_form_loss(logp, ref, tokens: list[int], estimator: str) -> torch.Tensor:
    """The policy loss of one group of one-token responses ``tokens`` (outcome reward 0), with the KL in the
    reward: ``gae`` (critic at 0, gamma = lam = 1) or an outcome estimator over the group."""
    rows = torch.tensor(tokens)
    lp, mask = logp[rows][:, None], torch.ones(len(tokens), 1, dtype=torch.bool)
    x = kl_penalty(lp, ref[rows][:, None], mask, "k1")
    rewards = kl_shaped_rewards(torch.zeros(len(tokens)), x, mask, BETA)
    if estimator == "gae":
        advantages, _ = gae(rewards, torch.zeros_like(rewards), mask, 1.0, 1.0)
    else:
        advantages = group_advantages(estimator, rewards.sum(dim=1), torch.arange(len(tokens))[None], 1e-6)
    loss, _ = policy_loss(lp, lp.detach(), lp.detach(), advantages, mask, AlgorithmConfig(is_weight="none"))
    return loss


@pytest.mark.parametrize("estimator, n", [("gae", 1), ("rloo", 2)])
def test_kl_in_the_reward_trains_beta_kl_pi_pi_ref(estimator, n):
    """Exact expectation over every group of ``n`` sampled tokens (``V ** n`` outcomes)."""
    theta, logp, ref = _policy()
    pi = logp.detach().exp()
    expected_loss = sum(torch.prod(pi[list(group)]) * _reward_form_loss(logp, ref, list(group), estimator)
                        for group in itertools.product(range(len(THETA)), repeat=n))
    grad = torch.autograd.grad(expected_loss, theta)[0]
    torch.testing.assert_close(grad, BETA * _kl_grad(FORWARD), atol=1e-6, rtol=1e-5)


def test_kl_shaped_rewards_hand_computed():
    mask = torch.tensor([[False, True, True, False], [False, True, False, False]])
    kl = torch.tensor([[9.0, 0.5, -1.0, 9.0], [9.0, 2.0, 9.0, 9.0]])  # off the mask: ignored
    out = kl_shaped_rewards(torch.tensor([1.0, 0.0]), kl, mask, 0.1)
    # row 0: -0.1 * 0.5 = -0.05; reward 1 on the last token: 1 - 0.1 * (-1) = 1.1; row 1: -0.2
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.05, 1.1, 0.0], [0.0, -0.2, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="coef"):
        kl_shaped_rewards(torch.zeros(2), kl, mask, -1.0)
    with pytest.raises(ValueError, match="kl has shape"):
        kl_shaped_rewards(torch.zeros(2), kl[:, :2], mask, 0.1)


def test_group_advantages_scatter_back_to_rows():
    # rows 0 and 2 form one group, rows 1 and 3 the other (not contiguous)
    returns = torch.tensor([1.0, 5.0, 3.0, 5.0])
    out = group_advantages("dr_grpo", returns, torch.tensor([[0, 2], [1, 3]]), 1e-6)
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="group_rows"):
        group_advantages("dr_grpo", returns, torch.tensor([0, 1, 2, 3]), 1e-6)
