"""Scoring off the event loop: code rewards take 0.1–2 s each, the rollout's asyncio loop must not wait.

``score_groups`` scores whole groups with their task's ``RewardSet`` (the worker's and the evaluation's
path); ``score_many`` scores single responses with per-response ``RewardFn``s. Responses are scored
concurrently in one small thread pool shared by the process (threads, not
processes: the sandbox starts its own child with fork+exec, and nothing here forks Python after gRPC
was used). A scorer that overruns its budget yields reward 0.0 with ``reward_error = "timeout: ..."``;
its thread cannot be killed and finishes on its own (the sandbox bounds code rewards, so only a hung
in-process scorer can hold a pool thread).
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from rollout.rewards.registry import RewardFn, RewardResult

if TYPE_CHECKING:
    from rollout.rewards.combined import GroupScore, RewardSet
    from rollout.rewards.function import Group

_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
POOL_THREADS = max(2, min(8, os.cpu_count() or 2))
"""Threads scoring at once (each code reward runs one sandboxed process)."""


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix="gyre-reward")
        return _POOL


async def score_many(items: list[tuple[RewardFn, str, dict]]) -> list[RewardResult]:
    """Score ``(reward_fn, response_text, entry)`` triples concurrently; results in input order.

    Never raises for a scorer's failure: each result carries reward 0.0 and a non-empty ``error``
    when its scorer raised or did not finish within ``timeout_s × ceil(len(items) / POOL_THREADS)``
    seconds (its own budget, scaled for the queueing of a batch larger than the pool).
    """
    loop = asyncio.get_running_loop()
    scale = math.ceil(len(items) / POOL_THREADS)

    async def one(fn: RewardFn, text: str, entry: dict) -> RewardResult:
        budget = fn.timeout_s * scale
        try:
            return await asyncio.wait_for(loop.run_in_executor(_pool(), fn.score, text, entry), budget)
        except asyncio.TimeoutError:
            return RewardResult(0.0, fn.version, f"timeout: not scored within {budget:.1f} s")

    return list(await asyncio.gather(*(one(fn, text, entry) for fn, text, entry in items)))


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
