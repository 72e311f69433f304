"""Prompt ledger: which prompt indices are issued, to whom, and which are complete.

Every change is explicit so the WAL can replay it exactly: the buffer asks ``due``/``plan`` what would
change, logs it, then applies it with ``apply_expire`` (overdue leases to the re-issue queue) and
``apply_lease`` (``(index, attempt)`` pairs with their deadline); ``complete`` marks a prompt done
(implied by the logged insert). ``lease``/``expire`` do both steps for in-process users. Restoring
the log therefore rebuilds the same ledger, and "each prompt index completes exactly once" survives
any crash.

A sharded replay's ledger (``shard`` of ``shards``) owns the indices ``shard, shard + shards, …`` only.

Completed indices are stored as a watermark (every owned index below it is complete) plus the set of
completed indices above it, so the state stays small however long the run. Lease deadlines sit in a min-heap
(stale entries dropped lazily), so ``due`` visits only the overdue leases, not every lease of a large fleet.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class PromptLease:
    """One prompt index leased to a rollout."""

    consumer: str
    """Rollout that holds it."""
    attempt: int
    """How many times the index was issued before (part of the trajectory id)."""
    expires_at: float
    """Clock seconds (wall clock by default, so it survives a restart) when it is re-issued."""


class PromptLedger:
    """Hands out prompt indices so that every index is completed exactly once.

    A prompt is *leased* to a rollout for ``ttl_s`` seconds; it becomes *complete* when replay
    stores a whole group for it. An expired lease is re-issued with ``attempt + 1``; whichever group
    arrives first completes the prompt and later ones are refused as duplicates.

    Args:
        num_prompts: size of the prompt stream, or ``None`` for unbounded.
        clock: seconds; wall clock by default because lease deadlines are persisted.
        shard, shards: this ledger owns the prompt indices ``i`` with ``i mod shards == shard`` (replay sharding,
            ``ReplayConfig.shards``); the default owns every index.

    Raises:
        ValueError: ``shards < 1`` or ``shard`` not in ``[0, shards)``.
    """

    def __init__(self, num_prompts: int | None = None, clock=time.time, shard: int = 0, shards: int = 1) -> None:
        if shards < 1 or not 0 <= shard < shards:
            raise ValueError(f"shard {shard} of {shards}: expected shards >= 1 and 0 <= shard < shards")
        self._num_prompts = num_prompts
        self._clock = clock
        self.shard, self.shards = shard, shards
        self._next_index = shard
        self._leases: dict[int, PromptLease] = {}
        self._deadlines: list[tuple[float, int, int]] = []
        """Min-heap of ``(expires_at, index, attempt)``, one per lease made; an entry whose lease has since ended or
        been re-issued is stale and skipped (the heap is rebuilt when stale entries outnumber live ones)."""
        self._expired: list[tuple[int, int]] = []
        self._done_below = shard
        self._done_above: set[int] = set()

    def owns(self, prompt_index: int) -> bool:
        """Whether ``prompt_index`` belongs to this ledger's shard."""
        return prompt_index % self.shards == self.shard

    def due(self, now: float | None = None) -> list[tuple[int, int]]:
        """Leases past their deadline as ``[(index, next_attempt)]``, earliest deadline first; changes nothing.
        Walks the deadline heap from its root, only through entries at or before ``now``: O(k log k) for k
        overdue entries, whatever the number of leases."""
        now = self._clock() if now is None else now
        out, heap = [], self._deadlines
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            (expires_at, index, attempt), pos = heapq.heappop(frontier)
            if expires_at > now:
                break  # every entry left in the frontier, and below it, is later
            lease = self._leases.get(index)
            if lease is not None and lease.expires_at == expires_at and lease.attempt == attempt:
                out.append((index, attempt + 1))
            for child in (2 * pos + 1, 2 * pos + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
        return out

    def expire(self, now: float | None = None) -> list[tuple[int, int]]:
        """Move leases past their deadline to the re-issue queue; returns ``[(index, next_attempt)]``."""
        out = self.due(now)
        self.apply_expire(out)
        return out

    def plan(self, count: int, below: int | None = None) -> list[tuple[int, int]]:
        """The ``[(index, attempt)]`` a lease of ``count`` would hand out now (re-issues first), only indices
        ``< below`` if given (lockstep); changes nothing."""
        out: list[tuple[int, int]] = [x for x in self._expired if below is None or x[0] < below][:count]
        next_index = self._next_index
        limit = self._num_prompts if below is None else min(below, self._num_prompts or below)
        while len(out) < count and (limit is None or next_index < limit):
            out.append((next_index, 0))
            next_index += self.shards
        return out

    def lease(self, consumer: str, count: int, ttl_s: float, now: float | None = None) -> list[tuple[int, int]]:
        """Lease up to ``count`` prompts; returns ``[(prompt_index, attempt)]`` (re-issues first).

        Raises:
            ValueError: ``count < 0`` or ``ttl_s <= 0``.
        """
        if count < 0:
            raise ValueError(f"count ({count}) must be >= 0")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s ({ttl_s}) must be > 0")
        now = self._clock() if now is None else now
        self.expire(now)
        out = self.plan(count)
        self.apply_lease(consumer, out, now + ttl_s)
        return out

    def apply_lease(self, consumer: str, items: list[tuple[int, int]], expires_at: float) -> None:
        """Record that ``items`` were leased to ``consumer`` until ``expires_at`` (live and WAL replay)."""
        issued = {i for i, _ in items}
        self._expired = [(i, a) for i, a in self._expired if i not in issued]
        for index, attempt in items:
            self._leases[index] = PromptLease(consumer, attempt, expires_at)
            heapq.heappush(self._deadlines, (expires_at, index, attempt))
            self._next_index = max(self._next_index, index + self.shards)
        if len(self._deadlines) > 2 * len(self._leases) + 64:
            self._rebuild_deadlines()

    def _rebuild_deadlines(self) -> None:
        self._deadlines = [(lease.expires_at, i, lease.attempt) for i, lease in self._leases.items()]
        heapq.heapify(self._deadlines)

    def apply_expire(self, items: list[tuple[int, int]]) -> None:
        """Move ``[(index, next_attempt)]`` from leased to the re-issue queue (live and WAL replay)."""
        for index, attempt in items:
            if self._leases.pop(index, None) is not None and not self.is_complete(index):
                self._expired.append((index, attempt))

    def complete(self, prompt_index: int) -> bool:
        """Mark a prompt complete. Returns False if it already was (the caller drops the group)."""
        if self.is_complete(prompt_index):
            return False
        self._done_above.add(prompt_index)
        while self._done_below in self._done_above:
            self._done_above.remove(self._done_below)
            self._done_below += self.shards
        self._leases.pop(prompt_index, None)
        self._expired = [(i, a) for i, a in self._expired if i != prompt_index]
        return True

    def complete_many(self, prompt_indices: list[int]) -> list[bool]:
        """``complete`` for each index in order (one insert's groups); returns the results."""
        out, done, newly = [], self._done_above, []
        for i in prompt_indices:
            fresh = i >= self._done_below and i not in done
            if fresh:
                done.add(i)
                newly.append(i)
            out.append(fresh)
        while self._done_below in done:
            done.remove(self._done_below)
            self._done_below += self.shards
        if self._leases:
            for i in newly:
                self._leases.pop(i, None)
        if self._expired:
            gone = set(newly)
            self._expired = [(i, a) for i, a in self._expired if i not in gone]
        return out

    def is_complete(self, prompt_index: int) -> bool:
        return prompt_index < self._done_below or prompt_index in self._done_above

    @property
    def num_completed(self) -> int:
        return (self._done_below - self.shard) // self.shards + len(self._done_above)

    @property
    def num_leased(self) -> int:
        return len(self._leases)

    def state_dict(self) -> dict:
        """Plain values: next index, leases, re-issue queue and completed indices."""
        return {
            "next_index": self._next_index,
            "leases": [[i, lease.consumer, lease.attempt, lease.expires_at] for i, lease in self._leases.items()],
            "expired": [list(x) for x in self._expired],
            "done_below": self._done_below,
            "done_above": sorted(self._done_above),
        }

    def load_state_dict(self, state: dict) -> None:
        self._next_index = int(state["next_index"])
        self._leases = {int(i): PromptLease(c, int(a), float(t)) for i, c, a, t in state["leases"]}
        self._rebuild_deadlines()
        self._expired = [(int(i), int(a)) for i, a in state["expired"]]
        self._done_below = int(state["done_below"])
        self._done_above = {int(i) for i in state["done_above"]}
