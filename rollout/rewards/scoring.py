"""A task's groups scored off the event loop: ``score_groups`` scores whole groups with their task's
``RewardSet`` (the worker's and the evaluation's path). Each reward scores in the process's scoring thread
pool (``rollout.rewards.base.score_many`` for a ``RewardFn``, one call per group for a ``FunctionReward``), so
the rollout's asyncio loop never waits on a scorer.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gyre.rollout.rewards.base import Group
    from gyre.rollout.rewards.combined import GroupScore, RewardSet


async def score_groups(items: list[tuple["RewardSet", "Group"]]) -> list["GroupScore"]:
    """Score ``(reward_set, group)`` pairs concurrently; one ``GroupScore`` per pair, in input order.

    Each distinct reward scores all the groups that use it in one batch (``score_groups`` of a ``RewardFn``:
    one ``score_many`` over their responses; of a ``FunctionReward``: one call per group). Never raises for
    a reward's failure: it is in the results' ``error``.
    """
    jobs: dict[int, tuple[object, list[tuple[int, int]]]] = {}
    for i, (reward_set, _) in enumerate(items):
        for k, part in enumerate(reward_set.parts):
            jobs.setdefault(id(part.reward), (part.reward, []))[1].append((i, k))
    batches = await asyncio.gather(*(reward.score_groups([items[i][1] for i, _ in refs])
                                     for reward, refs in jobs.values()))
    per_item: list[list] = [[None] * len(reward_set.parts) for reward_set, _ in items]
    for (_, refs), results in zip(jobs.values(), batches):
        for (i, k), result in zip(refs, results):
            per_item[i][k] = result
    return [reward_set.combine(per_item[i]) for i, (reward_set, _) in enumerate(items)]
