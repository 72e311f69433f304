"""Hand-computed checks of learner.advantages: Dr.GRPO, RLOO, REINFORCE++-baseline, outcome reward
placement and GAE (GRPO itself is covered in test_algorithms.py)."""

from __future__ import annotations

import pytest
import torch

from gyre.learner.algo.advantages import (
    dr_grpo_advantages,
    gae,
    outcome_advantages,
    outcome_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
)

REWARDS = torch.tensor([[0.0, 0.0, 3.0], [1.0, 2.0, 3.0]])  # group means 1 and 2


def test_dr_grpo_is_group_centred_without_std():
    # (0, 0, 3) - 1 = (-1, -1, 2); (1, 2, 3) - 2 = (-1, 0, 1)   (GRPO would divide by sqrt2 and 0.8165)
    expected = torch.tensor([[-1.0, -1.0, 2.0], [-1.0, 0.0, 1.0]])
    assert torch.equal(dr_grpo_advantages(REWARDS), expected)


def test_rloo_uses_the_other_samples_mean():
    # group 0: 0 - mean(0, 3) = -1.5; 0 - mean(0, 3) = -1.5; 3 - mean(0, 0) = 3
    # group 1: 1 - mean(2, 3) = -1.5; 2 - mean(1, 3) = 0;    3 - mean(1, 2) = 1.5
    # (= n / (n - 1) * Dr.GRPO = 1.5 * (-1, -1, 2) and 1.5 * (-1, 0, 1))
    expected = torch.tensor([[-1.5, -1.5, 3.0], [-1.5, 0.0, 1.5]])
    torch.testing.assert_close(rloo_advantages(REWARDS), expected)


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="RLOO needs groups of >= 2 samples.*group size 1"):
        rloo_advantages(torch.tensor([[1.0], [0.0]]))


def test_reinforce_pp_normalises_over_the_whole_batch():
    # centred: (-1, -1, 2, -1, 0, 1), batch mean 0, population var (1 + 1 + 4 + 1 + 0 + 1) / 6 = 4/3,
    # std 1.154701 -> (-0.866025, -0.866025, 1.732051, -0.866025, 0, 0.866025)
    # (per-group GRPO would give group 1 (-1.2247, 0, 1.2247) instead)
    expected = torch.tensor([[-0.866025, -0.866025, 1.732051], [-0.866025, 0.0, 0.866025]])
    torch.testing.assert_close(reinforce_pp_advantages(REWARDS, eps=1e-6), expected, atol=1e-5, rtol=0)
    assert torch.equal(reinforce_pp_advantages(torch.ones(2, 3), eps=1e-6), torch.zeros(2, 3))


def test_reinforce_pp_whitens_over_tokens_with_counts():
    """OpenRLHF's reinforce_baseline whitens per-token advantages: a row of n tokens counts n times."""
    counts = torch.tensor([[1, 3, 2], [4, 0, 2]])
    centred = REWARDS.float() - REWARDS.float().mean(dim=1, keepdim=True)
    tokens = torch.cat([centred.flatten()[i].repeat(int(c)) for i, c in enumerate(counts.flatten())])
    expected = (centred - tokens.mean()) / (tokens.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(reinforce_pp_advantages(REWARDS, 1e-6, counts), expected, atol=1e-6, rtol=0)
    assert not torch.allclose(expected, reinforce_pp_advantages(REWARDS, 1e-6), atol=1e-3)
    torch.testing.assert_close(reinforce_pp_advantages(REWARDS, 1e-6, torch.ones(2, 3)),
                               reinforce_pp_advantages(REWARDS, 1e-6))
    with pytest.raises(ValueError, match="token_counts"):
        reinforce_pp_advantages(REWARDS, 1e-6, torch.ones(3, 2))


def test_outcome_advantages_dispatch_and_errors():
    torch.testing.assert_close(outcome_advantages("rloo", REWARDS, 1e-6), rloo_advantages(REWARDS))
    torch.testing.assert_close(outcome_advantages("dr_grpo", REWARDS, 1e-6), dr_grpo_advantages(REWARDS))
    with pytest.raises(ValueError, match="'gae' is not an outcome estimator"):
        outcome_advantages("gae", REWARDS, 1e-6)
    with pytest.raises(ValueError, match="rewards must be"):
        dr_grpo_advantages(torch.zeros(3))
    with pytest.raises(ValueError, match=r"eps \(0.0\) must be > 0"):
        reinforce_pp_advantages(REWARDS, eps=0.0)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_group_baselines_refuse_groups_of_one(estimator):
    """Groups of one would silently train on advantage 0 (grpo, dr_grpo, reinforce_pp) or fail inside RLOO."""
    with pytest.raises(ValueError, match=f"'{estimator}' needs groups of >= 2 samples.*group size 1"):
        outcome_advantages(estimator, torch.tensor([[1.0], [0.0]]), 1e-6)


def test_outcome_reward_sits_on_the_last_response_token():
    mask = torch.tensor([[False, True, True, False], [True, False, False, False], [False] * 4])
    out = outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    # row 0: last valid index 2; row 1: index 0; row 2 has no response token -> no reward anywhere
    assert out.tolist() == [[0.0, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0] * 4]
    with pytest.raises(ValueError, match="rewards has shape"):
        outcome_token_rewards(torch.zeros(2), mask)


def test_gae_hand_computed():
    # one row: prompt at t0, response at t1..t3, padding at t4; reward 1 on t3; gamma 0.9, lam 0.5.
    mask = torch.tensor([[False, True, True, True, False]])
    values = torch.tensor([[9.0, 0.5, 0.6, 0.8, 9.0]])  # t0/t4 are ignored (off the mask)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    # t3 (terminal, next mask 0): delta = 1 - 0.8 = 0.2;                A3 = 0.2;                      R3 = 1.0
    # t2: delta = 0 + 0.9 * 0.8 - 0.6 = 0.12;  A2 = 0.12 + 0.9 * 0.5 * 0.2 = 0.21;                   R2 = 0.81
    # t1: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04;  A1 = 0.04 + 0.45 * 0.21 = 0.1345;                     R1 = 0.6345
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.1345, 0.21, 0.2, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.6345, 0.81, 1.0, 0.0]]))


def test_gae_with_gamma_lam_one_is_return_minus_value():
    # Monte-Carlo: A_t = (sum of future rewards) - V_t = 2 - V_t; returns are 2 everywhere.
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(torch.tensor([[0.0, 0.0, 2.0]]), torch.tensor([[0.5, 1.0, 1.5]]), mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[1.5, 1.0, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[2.0, 2.0, 2.0]]))
    # lam = 0 is one-step TD: A_t = r_t + V_{t+1} - V_t = (0.5, 0.5, 0.5)
    adv0, _ = gae(torch.tensor([[0.0, 0.0, 2.0]]), torch.tensor([[0.5, 1.0, 1.5]]), mask, 1.0, 0.0)
    torch.testing.assert_close(adv0, torch.tensor([[0.5, 0.5, 0.5]]))


def test_gae_carries_value_and_advantage_across_observation_tokens():
    # A two-turn episode: model tokens t0-t1, observation t2-t3 (mask 0), model tokens t4-t5, outcome reward 1 on
    # t5. With V = 0 and gamma = lam = 1 every model token's advantage is the return, 1 (issue #39's example);
    # before the fix the first turn got 0: the observation cut GAE off at t1.
    mask = torch.tensor([[True, True, False, False, True, True]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    adv, ret = gae(rewards, torch.zeros(1, 6), mask, gamma=1.0, lam=1.0)
    assert adv.tolist() == [[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]
    assert ret.tolist() == [[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]]
    # With a critic and discounting, t1 bootstraps from t4 (the next model token, one discount step away) and the
    # observation's own values (9.0) are never read.
    values = torch.tensor([[0.5, 0.6, 9.0, 9.0, 0.7, 0.8]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # t5: 1 - 0.8 = 0.2;  t4: 0.9*0.8 - 0.7 + 0.45*0.2 = 0.11;  t1: 0.9*0.7 - 0.6 + 0.45*0.11 = 0.0795;
    # t0: 0.9*0.6 - 0.5 + 0.45*0.0795 = 0.075775
    torch.testing.assert_close(adv, torch.tensor([[0.075775, 0.0795, 0.0, 0.0, 0.11, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[0.575775, 0.6795, 0.0, 0.0, 0.81, 1.0]]))


def test_gae_rejects_bad_input():
    mask = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"gamma \(1.5\) must lie in \[0, 1\]"):
        gae(torch.zeros(1, 3), torch.zeros(1, 3), mask, 1.5, 0.9)
    with pytest.raises(ValueError, match="must all be \\[B, T\\]"):
        gae(torch.zeros(1, 3), torch.zeros(1, 4), mask, 1.0, 0.9)
    with pytest.raises(ValueError, match="bool mask"):
        gae(torch.zeros(1, 3), torch.zeros(1, 3), mask.float(), 1.0, 0.9)
