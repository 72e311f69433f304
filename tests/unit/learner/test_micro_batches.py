"""``learner.micro_batches``: token shares balanced over ranks, micro-batches under the budget, equal counts."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from gyre.learner.micro_batches import karmarkar_karp, pack_by_tokens, row_count_plan, token_budget_plan


def _optimal_max(weights: list[int], k: int) -> int:
    """Brute force: the smallest possible largest subset sum."""
    return min(max(sum(w for w, s in zip(weights, assign) if s == j) for j in range(k))
               for assign in itertools.product(range(k), repeat=len(weights)))


@pytest.mark.parametrize("k", [2, 3])
def test_karmarkar_karp_is_within_5_percent_of_optimal(k):
    rng = random.Random(0)
    for _ in range(20):
        weights = [rng.choice([rng.randint(40, 200), rng.randint(200, 1800)]) for _ in range(9)]
        parts = karmarkar_karp(weights, k)
        assert sorted(i for p in parts for i in p) == list(range(9))
        assert max(sum(weights[i] for i in p) for p in parts) <= 1.05 * _optimal_max(weights, k)


def test_grpo_shaped_rows_split_evenly_over_eight_ranks():
    """128 rows with GRPO-math's heavy tail: the fullest rank holds within 2% of the mean; contiguous shares
    (the row-count split) are far off."""
    rng = random.Random(1)
    lengths = [rng.randint(64, 320) + int(min(1536, 32 + rng.expovariate(1 / 350))) for _ in range(128)]
    parts = karmarkar_karp(lengths, 8)
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert max(sums) <= 1.02 * sum(lengths) / 8
    contiguous = [sum(lengths[i * 16:(i + 1) * 16]) for i in range(8)]
    assert max(contiguous) > max(sums)


def test_first_fit_decreasing_respects_the_budget():
    rows, lengths = list(range(10, 20)), [700, 300, 250, 900, 100, 650, 400, 120, 80, 500]
    bins = pack_by_tokens(rows, lengths, 1000)
    length = dict(zip(rows, lengths))
    assert sorted(r for b in bins for r in b) == rows
    assert all(sum(length[r] for r in b) <= 1000 for b in bins)
    assert len(bins) <= 11 * 4 // 9 + 1  # FFD: at most 11/9 OPT + 6/9 bins (Dósa 2007); OPT = 4 here


def test_a_row_over_the_budget_is_named():
    with pytest.raises(ValueError, match="row 7 has 1200 tokens, more than learner.engine.micro_batch_tokens "
                                         r"\(1000\)"):
        pack_by_tokens([3, 7], [10, 1200], 1000)


def test_every_rank_runs_the_same_number_of_micro_batches():
    lengths = torch.tensor([900, 100, 100, 100, 100, 880, 50, 60])
    plan = token_budget_plan(lengths, range(8), world=2, budget=1000)
    assert len(plan[0]) == len(plan[1])
    assert sorted(r for rank in plan for mb in rank if mb for r in mb) == list(range(8))
    assert all(int(lengths[mb].sum()) <= 1000 for rank in plan for mb in rank if mb)


def test_a_rank_short_of_rows_gets_empty_micro_batches():
    plan = token_budget_plan(torch.tensor([1000, 990, 990]), range(3), world=2, budget=1000)
    assert plan == [[[1], [2]], [[0], None]]  # rank 1 holds the one 1000-token row: an empty second micro-batch


def test_row_count_plan_keeps_contiguous_shares():
    assert row_count_plan(range(4, 12), 2, 3) == [[[4, 5, 6], [7]], [[8, 9, 10], [11]]]
    with pytest.raises(ValueError, match="mini-batch of 7 rows cannot be sharded over 2"):
        row_count_plan(range(7), 2, 3)


def test_a_token_budget_config_survives_its_own_dump(tmp_path):
    """The driver sends ``model_dump()`` to the learner actor, which validates it again: a recipe with a token budget
    must reload (found when the default recipe moved to ``micro_batch_tokens``: its dump carried
    ``micro_batch_size: 8`` and was refused as setting both)."""
    from gyre.learner.config import LearnerConfig

    (tmp_path / "config.json").write_text("{}")
    cfg = LearnerConfig(model=str(tmp_path), micro_batch_tokens=4096)
    again = LearnerConfig(**cfg.model_dump())
    assert again.micro_batch_tokens == 4096 and again.micro_batch_size is None
    assert LearnerConfig(model=str(tmp_path)).rows_per_micro_batch == 8
    with pytest.raises(ValueError, match=r"micro_batch_size \(4\) and micro_batch_tokens \(4096\) are both set"):
        LearnerConfig(model=str(tmp_path), micro_batch_size=4, micro_batch_tokens=4096)
