"""DAPO's overlong handling (Yu et al. 2025): truncated rows (``finish_reason "length"``) masked out of the loss
but kept in their group's baseline (``overlong_filter``), the soft overlong punishment added to the rewards before
the advantages (``overlong_buffer_len``), the knobs' validation, and the batch's truncation metrics."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from gyre.learner.algo.advantages import overlong_penalty, reinforce_pp_advantages
from gyre.learner.algo.logprobs import token_logprobs
from gyre.learner.batch import build_train_batch, truncation_metrics
from gyre.learner.config import AlgorithmConfig
from gyre.learner.algo.kl_control import KLController
from gyre.learner.step_metrics import batch_metrics
from gyre.learner.step_start import step_targets
from gyre.proto.trajectory import to_table
from tests.unit.learner.test_batch import PAD, _rows


def _truncated_rows(*which: int):
    """``test_batch._rows`` (groups 7-0: rows 0, 2 with rewards 1, 0; 9-0: rows 1, 3 with rewards 0, 0; response
    lengths 2, 4, 1, 1) with the rows ``which`` cut at the budget."""
    return [dataclasses.replace(r, finish_reason="length") if i in which else r for i, r in enumerate(_rows())]


def _batch(rows, **cfg):
    return build_train_batch(to_table(rows), pad_token_id=PAD, learner_version=4, cfg=AlgorithmConfig(**cfg))


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_soft_penalty_is_zero_then_linear_in_the_buffer_then_capped(factor):
    # L_max 10, L_cache 4: no penalty up to 6 tokens, -1/4 per token after, -factor at 10 and beyond
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10, 11])
    got = overlong_penalty(lengths, max_len=10, buffer_len=4, factor=factor)
    expected = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]) * factor
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match=r"buffer_len \(10\) must be >= 1 and < max_len \(10\)"):
        overlong_penalty(lengths, max_len=10, buffer_len=10, factor=1.0)


def test_buffer_is_refused_without_a_budget_or_as_large_as_it():
    assert AlgorithmConfig().overlong_buffer_len == 0 and not AlgorithmConfig().overlong_filter  # off by default
    with pytest.raises(ValueError, match=r"overlong_buffer_len \(8\) needs the generation budget L_max.*"
                                         r"got max_response_tokens None"):
        AlgorithmConfig(overlong_buffer_len=8)
    with pytest.raises(ValueError, match=r"overlong_buffer_len \(32\) must be < max_response_tokens \(32\)"):
        AlgorithmConfig(overlong_buffer_len=32, max_response_tokens=32)
    with pytest.raises(ValueError, match="overlong_penalty_factor"):
        AlgorithmConfig(overlong_buffer_len=8, max_response_tokens=32, overlong_penalty_factor=0.0)
    assert AlgorithmConfig(overlong_buffer_len=31, max_response_tokens=32).overlong_buffer_len == 31


def test_filter_masks_truncated_rows_out_of_the_loss_but_not_out_of_the_baseline():
    plain, off, on = _batch(_rows()), _batch(_truncated_rows(0)), _batch(_truncated_rows(0), overlong_filter=True)
    assert on.truncated.tolist() == off.truncated.tolist() == [True, False, False, False]
    # off (the default): the truncated row trains like a finished one
    assert torch.equal(off.response_mask, plain.response_mask)
    # on: row 0 neither trains nor counts in the token normaliser; the other rows are unchanged
    assert not on.response_mask[0].any() and on.behaviour_logprobs[0].eq(0).all()
    assert torch.equal(on.response_mask[1:], plain.response_mask[1:])
    assert torch.equal(on.behaviour_logprobs[1:], plain.behaviour_logprobs[1:])
    assert on.num_response_tokens == plain.num_response_tokens - 2
    # group 7-0 keeps row 0's reward 1 in its baseline: row 2 is still below the mean (without row 0 it would be 0)
    torch.testing.assert_close(on.advantages, torch.tensor([1.0, 0.0, -1.0, 0.0]), atol=1e-5, rtol=0)
    assert torch.equal(on.input_ids, plain.input_ids) and torch.equal(on.rewards, plain.rewards)


def test_soft_penalty_enters_the_advantages_not_the_reported_rewards():
    # L_max 4, L_cache 2: lengths 2, 4, 1, 1 -> penalties 0, -1, 0, 0
    batch = _batch(_rows(), max_response_tokens=4, overlong_buffer_len=2)
    assert batch.overlong_penalty.tolist() == [0.0, -1.0, 0.0, 0.0]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]  # the verifier's
    assert batch.shaped_rewards.tolist() == [1.0, -1.0, 0.0, 0.0]
    # group 9-0 (0, 0) becomes (-1, 0): GRPO (-1, +1); group 7-0 (1, 0) is untouched: (+1, -1)
    torch.testing.assert_close(batch.advantages, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    off = _batch(_rows(), max_response_tokens=4)
    assert off.overlong_penalty.eq(0).all()
    torch.testing.assert_close(off.advantages, torch.tensor([1.0, 0.0, -1.0, 0.0]), atol=1e-5, rtol=0)


def test_truncation_metrics():
    cfg = AlgorithmConfig(max_response_tokens=4, overlong_buffer_len=2)
    batch = build_train_batch(to_table(_truncated_rows(1)), PAD, 4, cfg)
    assert truncation_metrics(batch, cfg) == {"truncated_frac": 0.25, "overlong_penalty_mean": -0.25}
    assert truncation_metrics(_batch(_truncated_rows(1, 3)), AlgorithmConfig()) == {"truncated_frac": 0.5}
    assert truncation_metrics(_batch(_rows()), AlgorithmConfig()) == {"truncated_frac": 0.0}



def test_step_metrics_carry_the_truncated_fraction_and_the_raw_reward():
    cfg = AlgorithmConfig(max_response_tokens=4, overlong_buffer_len=2)
    batch = build_train_batch(to_table(_truncated_rows(1)), PAD, 4, cfg)
    metrics = batch_metrics(batch, None, cfg)
    assert metrics["truncated_frac"] == 0.25 and metrics["overlong_penalty_mean"] == -0.25
    assert metrics["reward_mean"] == 0.25  # the verifier's (1, 0, 0, 0), the penalty left out


class _FakeLearner:
    """Test double of the ``LearnerEngine`` parts ``step_targets`` reads: logits (and the critic's values, 0) from
    fixed embedding tables, the reference model's from another table."""

    def __init__(self, algo: AlgorithmConfig) -> None:
        g = torch.Generator().manual_seed(0)
        self.algo, self.critic = algo, algo.advantage == "gae"
        self.policy, self.reference = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
        self.ref_model = object() if algo.kl_coef > 0 else None
        self.kl_ctrl = KLController(algo.kl_coef, algo.kl_ctrl)
        self.engine = torch.nn.Linear(1, 1)

    def _micro_plan(self, batch, rows=None):
        return [torch.tensor([0, 1, 2]), torch.tensor([3])], 1  # two micro-batches over four rows

    def _pass(self, batch, rows, entropy=False):
        length = int(batch.attention_mask[rows].sum(dim=1).max())
        ids, mask = batch.input_ids[rows, :length], batch.response_mask[rows, : length - 1]
        values = torch.zeros(len(rows), length - 1) if self.critic else None
        logprobs = token_logprobs(self.policy[ids], ids, self.algo.temperature) * mask
        return types.SimpleNamespace(logprobs=logprobs, mask=mask, values=values)

    def _ref_logprobs(self, batch, rows):
        length = int(batch.attention_mask[rows].sum(dim=1).max())
        ids = batch.input_ids[rows, :length]
        return token_logprobs(self.reference[ids], ids, self.algo.temperature) * batch.response_mask[rows, : length - 1]

    def kl(self, batch) -> torch.Tensor:
        """``[B]`` sum over each row's valid response tokens of ``log pi - log pi_ref``."""
        ids = batch.input_ids
        x = token_logprobs(self.policy[ids], ids) - token_logprobs(self.reference[ids], ids, self.algo.temperature)
        return torch.where(batch.response_mask, x, torch.zeros_like(x)).sum(dim=1)


def test_kl_in_the_reward_keeps_the_penalty_and_the_filtered_rows_reward_in_the_baseline():
    algo = AlgorithmConfig(kl_coef=0.1, kl_placement="reward", kl_estimator="k1", overlong_filter=True,
                           max_response_tokens=4, overlong_buffer_len=2)
    batch = build_train_batch(to_table(_truncated_rows(0)), PAD, 4, algo)  # row 0 masked; row 1 penalised (-1)
    learner = _FakeLearner(algo)
    returns = batch.shaped_rewards - 0.1 * learner.kl(batch)  # row 0: no tokens, so its reward 1 alone
    assert returns[0] == 1.0 and batch.overlong_penalty[1] == -1.0
    expected = (returns - returns[[2, 3, 0, 1]]).sign()  # groups of two: GRPO gives +-1 (rows 0/2, 1/3)
    torch.testing.assert_close(step_targets(learner, batch).advantages, expected, atol=1e-4, rtol=0)


def test_gae_sees_the_penalty_on_the_last_token():
    algo = AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0, max_response_tokens=4, overlong_buffer_len=2)
    batch = build_train_batch(to_table(_rows()), PAD, 4, algo)
    targets = step_targets(_FakeLearner(algo), batch)  # V = 0: every token's advantage is the row's return
    for row, reward in enumerate(batch.shaped_rewards.tolist()):
        assert targets.advantages[row][batch.response_mask[row]].tolist() == pytest.approx([reward] * int(
            batch.response_mask[row].sum())), row
    assert batch.shaped_rewards[1] == -1.0


def test_a_gae_batch_whose_rows_are_all_filtered_reports_zero_advantage():
    """Every row truncated and filtered: nothing trains, and ``advantage_abs_mean`` is 0 rather than NaN."""
    algo = AlgorithmConfig(advantage="gae", overlong_filter=True)
    batch = build_train_batch(to_table(_truncated_rows(0, 1, 2, 3)), PAD, 4, algo)
    assert not batch.response_mask.any()
    targets = step_targets(_FakeLearner(algo), batch)
    metrics = batch_metrics(batch, targets, algo)
    assert metrics["advantage_abs_mean"] == 0.0 and metrics["truncated_frac"] == 1.0


def _episode(row, turns: list[int], observations: list[int]):
    """``row`` as a multi-turn episode: model turns of ``turns`` tokens (mask 1) with observations of
    ``observations`` tokens (mask 0) between them."""
    ids, mask, starts = [], [], []
    for k, n in enumerate(turns):
        starts.append(len(ids))
        ids += [300 + k] * n
        mask += [1] * n
        if k < len(observations):
            ids += [400 + k] * observations[k]
            mask += [0] * observations[k]
    return dataclasses.replace(row, response_token_ids=ids, behaviour_logprobs=[-0.1] * len(ids), loss_mask=mask,
                               turn_starts=starts, episode_end="done")


def test_the_soft_penalty_measures_each_model_turn_against_its_budget():
    # Issue #39's case: 3 turns of 20 tokens, two 30-token observations, budget 64 per turn, buffer 16. Each turn
    # is well inside its budget: no penalty. Before the fix |y| was all 120 response tokens: the maximum -1.0.
    rows = _rows()
    rows[0] = _episode(rows[0], [20, 20, 20], [30, 30])
    rows[1] = _episode(rows[1], [20, 60], [30])  # its second turn is 12 tokens into the buffer: -12/16
    batch = _batch(rows, max_response_tokens=64, overlong_buffer_len=16)
    assert batch.overlong_penalty.tolist() == [0.0, -0.75, 0.0, 0.0]


def test_reinforce_pp_whitens_over_the_tokens_that_train():
    # Row 1 (group 9-0, 4 tokens, centred advantage 0) is cut and filtered out of the loss: it stays in its group's
    # mean (DAPO) but its tokens no longer weigh in the batch whitening. Before the fix they did (std over
    # 2 + 4 + 1 + 1 tokens instead of 2 + 1 + 1).
    batch = _batch(_truncated_rows(1), advantage="reinforce_pp", overlong_filter=True)
    centred = torch.tensor([[0.5, -0.5], [0.0, 0.0]])  # groups 7-0 (rows 0, 2), 9-0 (rows 1, 3)
    expected = reinforce_pp_advantages(torch.tensor([[1.0, 0.0], [0.0, 0.0]]), AlgorithmConfig().adv_eps,
                                       torch.tensor([[2, 1], [0, 1]]))
    assert expected.shape == centred.shape
    torch.testing.assert_close(batch.advantages, expected[[0, 1, 0, 1], [0, 0, 1, 1]])
    assert not batch.response_mask[1].any()


def test_reward_and_advantage_metrics_count_only_the_rows_that_train():
    # Issue #39: row 0 (reward 1) is cut and filtered out of the loss, row 3's score failed, which leaves its group
    # (rows 1, 3) without a baseline: only row 2 trains (reward 0, advantage -1). Before the fix reward_mean counted
    # all four rows: 0.25, a filtered or failed row moving the reward curve; advantage_abs_mean 0.5.
    rows = _truncated_rows(0)
    rows[3] = dataclasses.replace(rows[3], reward_error="reward_fn_error: boom", reward=0.0)
    algo = AlgorithmConfig(overlong_filter=True)
    batch = build_train_batch(to_table(rows), PAD, 4, algo)
    metrics = batch_metrics(batch, None, algo)
    assert metrics["reward_mean"] == 0.0 and metrics["reward_std"] == 0.0
    assert metrics["reward_error_frac"] == 0.25
    assert batch.baseline_rows.tolist() == [True, False, True, False]
    assert metrics["advantage_abs_mean"] == pytest.approx(1.0, abs=1e-4)
