"""A custom advantage estimator: REINFORCE with a leave-one-out baseline over the whole batch.

Recipe: ``learner.algorithm.advantage: "examples/objectives/advantages.py:batch_loo"`` (a file path, relative to
where gyre runs) or ``"examples.objectives.advantages:batch_loo"`` (a module, importable from there).
"""

from __future__ import annotations

import torch

from gyre.learner.algo.objectives import AdvantageInputs


def batch_loo(inputs: AdvantageInputs) -> torch.Tensor:
    """REINFORCE advantages ``A_i = r_i - b_i`` with ``b_i`` the mean return of the batch's *other* scored rows
    (Williams 1992, "Simple statistical gradient-following algorithms"; the leave-one-out baseline of Kool et
    al. 2019 / Ahmadian et al. 2024, over the batch instead of the group).

    ``b_i`` does not depend on row ``i``'s own sample, so ``A_i * grad log pi(y_i)`` is an unbiased estimate of
    the policy gradient ``grad E[r]``. Unlike the group baselines (``grpo``, ``rloo``) it ignores which prompt a
    row answers: with prompts of very different difficulty its variance is higher, but it needs no groups and
    works with ``rollout.group_size: 1``.

    Args:
        inputs: ``rewards`` ``[B]`` float32 and ``scored`` ``[B]`` bool are used (see
            ``learner.objectives.AdvantageInputs``).

    Returns:
        ``[B]`` float32: one advantage per row, broadcast over its response tokens; 0 for a row outside
        ``scored`` and when fewer than 2 rows are scored (no other row to form a baseline).
    """
    scored = inputs.scored
    k = int(scored.sum())
    if k < 2:
        return torch.zeros_like(inputs.rewards)
    r = torch.where(scored, inputs.rewards, torch.zeros_like(inputs.rewards))
    others_mean = (r.sum() - r) / (k - 1)
    return torch.where(scored, r - others_mean, torch.zeros_like(r))
