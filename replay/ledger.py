"""Prompt ledger: which prompt indices are issued, to whom, and which are complete."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class _PromptLease:
    consumer: str
    attempt: int
    expires_at: float
    """Monotonic-clock seconds."""


class PromptLedger:
    """Hands out prompt indices so that every index is completed exactly once.

    A prompt is *leased* to a rollout for ``ttl_s`` seconds; it becomes *complete* when replay
    stores a whole group for it. An expired lease is re-issued with ``attempt + 1``; whichever group
    arrives first completes the prompt and later ones are refused as duplicates.

    Args:
        num_prompts: size of the prompt stream, or ``None`` for unbounded.
        clock: monotonic clock in seconds (injectable for tests).
    """

    def __init__(self, num_prompts: int | None = None, clock=time.monotonic) -> None:
        self._num_prompts = num_prompts
        self._clock = clock
        self._next_index = 0
        self._leases: dict[int, _PromptLease] = {}
        self._expired: list[tuple[int, int]] = []
        self._completed: set[int] = set()

    def lease(self, consumer: str, count: int, ttl_s: float) -> list[tuple[int, int]]:
        """Lease up to ``count`` prompts; returns ``[(prompt_index, attempt)]`` (re-issues first)."""
        if count < 0:
            raise ValueError(f"count ({count}) must be >= 0")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s ({ttl_s}) must be > 0")
        self._expire()
        out: list[tuple[int, int]] = []
        now = self._clock()
        while len(out) < count and self._expired:
            index, attempt = self._expired.pop(0)
            out.append((index, attempt))
        while len(out) < count and (self._num_prompts is None or self._next_index < self._num_prompts):
            out.append((self._next_index, 0))
            self._next_index += 1
        for index, attempt in out:
            self._leases[index] = _PromptLease(consumer, attempt, now + ttl_s)
        return out

    def complete(self, prompt_index: int) -> bool:
        """Mark a prompt complete. Returns False if it already was (the caller drops the group)."""
        if prompt_index in self._completed:
            return False
        self._completed.add(prompt_index)
        self._leases.pop(prompt_index, None)
        self._expired = [(i, a) for i, a in self._expired if i != prompt_index]
        return True

    def is_complete(self, prompt_index: int) -> bool:
        return prompt_index in self._completed

    @property
    def num_completed(self) -> int:
        return len(self._completed)

    @property
    def num_leased(self) -> int:
        return len(self._leases)

    def _expire(self) -> None:
        now = self._clock()
        for index, lease in list(self._leases.items()):
            if lease.expires_at <= now:
                del self._leases[index]
                self._expired.append((index, lease.attempt + 1))
