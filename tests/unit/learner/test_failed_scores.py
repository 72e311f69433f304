"""Failed scores are not trained (issue #22 item 4): a row with a ``reward_error`` (its scorer raised, returned
None, timed out) leaves the loss and its group's baseline (``failed_scores: mask_rows``), or takes its whole group
with it (``drop_groups``); the metrics count them. Before, such rows trained as reward 0."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gyre.learner.algo.advantages import group_advantages, masked_group_advantages
from gyre.learner.algo.logprobs import token_logprobs
from gyre.learner.batch import build_train_batch, reward_error_metrics
from gyre.learner.config import AlgorithmConfig
from gyre.learner.algo.losses import loss_normaliser, policy_loss
from gyre.learner.step_start import step_targets
from gyre.proto.trajectory import to_table
from tests.unit.learner.test_batch import PAD, _traj
from tests.unit.learner.test_overlong import _FakeLearner


def _group(prompt_index: int, rewards: list[float], errors: dict[int, str] | None = None, start: int = 0):
    """One group of ``len(rewards)`` samples with distinct responses; ``errors``: sample -> reward_error."""
    rows = [_traj(prompt_index, s, [11 + prompt_index, 12, 13], [40 + 7 * s + k for k in range(2 + s % 3)], r)
            for s, r in enumerate(rewards)]
    return [dataclasses.replace(t, reward=0.0, reward_error=(errors or {})[s]) if s in (errors or {}) else t
            for s, t in enumerate(rows)][start:]


def test_masked_group_advantages_form_baselines_of_the_scored_rows_only():
    returns = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0])
    rows = torch.tensor([[0, 1, 2], [3, 4, 5]])
    valid = torch.tensor([True, False, True, True, True, True])
    adv, trained = masked_group_advantages("grpo", returns, rows, 1e-6, valid)
    torch.testing.assert_close(adv[[0, 2]], torch.tensor([1.0, -1.0]), atol=1e-5, rtol=0)  # (1, 0.5) alone
    assert adv[1] == 0.0 and trained.tolist() == [True, False, True, True, True, True]
    torch.testing.assert_close(adv[3:], group_advantages("grpo", returns[3:], torch.tensor([[0, 1, 2]]), 1e-6))
    # a group left with one scored row has no baseline: nothing of it trains
    adv, trained = masked_group_advantages("rloo", returns, rows, 1e-6, torch.tensor([True, False, False] + [True] * 3))
    assert trained.tolist() == [False, False, False, True, True, True] and adv[:3].tolist() == [0.0, 0.0, 0.0]
    # every row valid: the same as the unmasked estimator, reinforce_pp's token whitening included
    counts = torch.tensor([3, 1, 2, 5, 4, 2])
    for estimator in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        adv, _ = masked_group_advantages(estimator, returns, rows, 1e-6, torch.ones(6, dtype=torch.bool), counts)
        torch.testing.assert_close(adv, group_advantages(estimator, returns, rows, 1e-6, counts), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="valid must be"):
        masked_group_advantages("grpo", returns, rows, 1e-6, torch.ones(5, dtype=torch.bool))


@pytest.mark.parametrize("mode", ["mask_rows", "drop_groups"])
def test_failed_rows_leave_the_loss_and_the_baseline(mode):
    cfg = AlgorithmConfig(failed_scores=mode)
    rows = _group(1, [1.0, 0.0, 1.0, 0.5], {1: "timeout: not scored within 30.0 s"}) + _group(2, [0.0, 1.0, 0.0, 0.0])
    batch = build_train_batch(to_table(rows), PAD, 3, cfg)
    failed = [False, True, False, False] + [False] * 4
    assert batch.reward_failed.tolist() == failed
    out = [True] * 4 + [False] * 4 if mode == "drop_groups" else failed
    assert batch.baseline_rows.tolist() == [not o for o in out]
    assert [bool(batch.response_mask[r].any()) for r in range(8)] == [not o for o in out]
    assert float(batch.behaviour_logprobs[torch.tensor(out)].abs().sum()) == 0.0
    if mode == "mask_rows":  # group 1's baseline: rewards (1, 1, 0.5) of its scored rows; row 1 gets nothing
        expected = group_advantages("grpo", torch.tensor([1.0, 1.0, 0.5]), torch.tensor([[0, 1, 2]]), 1e-6)
        torch.testing.assert_close(batch.advantages[[0, 2, 3]], expected)
    assert batch.advantages[torch.tensor(out)].abs().sum() == 0.0
    assert reward_error_metrics(batch) == {"reward_error_frac": 1 / 8, "reward_error_untrained_frac": sum(out) / 8}


def _policy_gradient(model, batch, cfg) -> list[torch.Tensor]:
    model.zero_grad()
    ids = batch.input_ids
    logprobs = token_logprobs(model(input_ids=ids, attention_mask=batch.attention_mask).logits, ids)
    loss, _ = policy_loss(logprobs, logprobs.detach(), batch.behaviour_logprobs, batch.advantages,
                          batch.response_mask, cfg, normaliser=loss_normaliser(cfg, batch.response_mask))
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("error", ["raised: ValueError: no number", "reward function returned None",
                                   "timeout: not scored within 30.0 s"])
def test_the_gradient_with_failed_rows_is_the_gradient_without_them(error):
    """A group of 5 with two failed rows trains exactly like the group of its 3 scored rows alone."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         max_position_embeddings=64))
    cfg = AlgorithmConfig()
    rewards = [1.0, 0.0, 0.25, 1.0, 0.0]
    with_failed = build_train_batch(to_table(_group(3, rewards, {1: error, 4: error})), PAD, 3, cfg)
    scored = [t for t in _group(3, rewards) if t.sample_index in (0, 2, 3)]
    without = build_train_batch(to_table(scored), PAD, 3, cfg)
    assert with_failed.num_response_tokens == without.num_response_tokens
    for a, b in zip(_policy_gradient(model, with_failed, cfg), _policy_gradient(model, without, cfg)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_kl_in_the_reward_and_gae_leave_failed_rows_out():
    rows = _group(1, [1.0, 0.0, 1.0, 0.5], {0: "raised: KeyError: 'answer'"})
    kl = AlgorithmConfig(kl_coef=0.1, kl_placement="reward", kl_estimator="k1")
    batch = build_train_batch(to_table(rows), PAD, 3, kl)
    learner = _FakeLearner(kl)
    returns = batch.rewards - 0.1 * learner.kl(batch)
    expected = group_advantages("grpo", returns[1:], torch.tensor([[0, 1, 2]]), 1e-6)
    adv = step_targets(learner, batch).advantages
    assert adv[0] == 0.0
    torch.testing.assert_close(adv[1:], expected, atol=1e-5, rtol=0)
    gae = AlgorithmConfig(advantage="gae")
    batch = build_train_batch(to_table(rows), PAD, 3, gae)
    assert batch.baseline_rows.tolist() == [False, True, True, True] and not batch.response_mask[0].any()
    assert step_targets(_FakeLearner(gae), batch).advantages[0].abs().sum() == 0.0
