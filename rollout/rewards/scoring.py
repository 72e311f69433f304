"""Scoring off the event loop: code rewards take 0.1–2 s each, the rollout's asyncio loop must not wait.

Responses are scored concurrently in one small thread pool shared by the process (threads, not
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

from rollout.rewards.registry import RewardFn, RewardResult

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
