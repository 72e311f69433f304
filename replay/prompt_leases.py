"""Prompt leasing: which prompt indices a rollout generates for next (``LeasePrompts``), over the buffer's log.

Replay owns the run's prompt ledger (``replay.ledger``: issued, leased, completed) so that a prompt is trained on
exactly once per epoch however often rollouts crash: a rollout leases indices for ``prompt_lease_ttl_s``, a
completed group marks its prompt done, and a lease that expires re-issues its prompt first. Every change is a
record (``prompt_expire``, ``prompt_lease``) logged and applied under the buffer's lock, like the buffer's own
changes, so a crash never takes back an index it handed out.
"""

from __future__ import annotations

from typing import Callable

from gyre.replay.records import Record
from gyre.replay.state import ReplayState
from gyre.replay.types import POOLED


class PromptLeases:
    """Hands out prompt indices from ``state.ledger``.

    Args:
        state: the buffer's state (its ``ledger``).
        lock: the buffer's lock; ``commit(record)`` logs then applies a record under it and returns
            ``(lsn, result)``; ``wait_durable(lsn)`` blocks until that record is durable.
        clock: seconds (wall clock: lease deadlines are persisted).
        default_ttl_s: a lease's lifetime when the caller gives none (``ReplayConfig.prompt_lease_ttl_s``).
    """

    def __init__(self, state: ReplayState, lock, commit: Callable[[Record], tuple[int, object]],
                 wait_durable: Callable[[int], None], clock: Callable[[], float], default_ttl_s: float) -> None:
        self._state, self._lock, self._commit, self._wait_durable = state, lock, commit, wait_durable
        self._clock, self._default_ttl_s = clock, default_ttl_s

    def lease(self, consumer: str, count: int, ttl_s: float | None = None, below: int | None = None,
              max_ready: int | None = None, policy_version: int | None = None) -> list[tuple[int, int]]:
        """Lease up to ``count`` prompt indices to ``consumer`` for ``ttl_s`` seconds: ``[(prompt_index, attempt)]``,
        expired (re-issued) ones first; with ``below`` only indices under it (lockstep: prompts whose policy version
        is published). Fewer, or none, when the fleet's work budget (``budget``) is spent, or when ``max_ready``
        groups or more are ready (the rollout's own backpressure; never below this shard's share of a learner batch,
        ``_batch_share``); ``policy_version``: the rollout's weights, whose lag behind the learner the budget counts
        (``ReplayState.work_budget_left``). Returns once the lease is durable. Raises
        ``ValueError`` for a negative ``count``."""
        if count < 0:
            raise ValueError(f"count ({count}) must be >= 0")
        ttl = ttl_s or self._default_ttl_s
        with self._lock:
            now, lsn = self._clock(), -1
            due = self._state.ledger.due(now)
            if due:
                lsn, _ = self._commit(Record("prompt_expire", {"items": due}))
            if max_ready is not None and self._state.store.count[POOLED] >= max(max_ready, self._batch_share()):
                count = 0
            budget = self._state.work_budget_left(policy_version)
            if budget is not None:
                count = min(count, max(0, budget))
            items = self._state.ledger.plan(count, below) if count else []
            if items:
                lsn, _ = self._commit(Record("prompt_lease", {"consumer": consumer, "items": items,
                                                              "expires_at": now + ttl}))
        self._wait_durable(lsn)
        return items

    def _batch_share(self) -> int:
        """This shard's share of one learner batch (``ceil(groups_per_step / shards)``; 0 without
        ``groups_per_step``): a rollout's ``max_ready`` never stops leasing below it, else a ``max_ready`` under the
        batch would leave the learner waiting for ever for a batch the rollouts will not generate."""
        cfg = self._state.config
        return -(-cfg.groups_per_step // cfg.shards) if cfg.groups_per_step else 0

    def budget(self) -> int | None:
        """Groups the fleet may still lease (``ReplayConfig.work_budget`` − groups ready − prompts leased, may be
        negative), or ``None`` without a budget."""
        with self._lock:
            return self._state.work_budget_left()
