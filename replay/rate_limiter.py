"""Samples-per-insert rate limiter (Reverb semantics, counted in whole groups), built not to deadlock.

State: ``inserted`` and ``sampled`` group counts. With ``s = samples_per_insert``,
``diff = s * inserted - sampled`` must stay in ``[min_diff, max_diff]`` where
``min_diff = s * min_size_to_sample - error_buffer`` and ``max_diff = s * min_size_to_sample + error_buffer``.

Decision rules (``size`` = groups stored and not excluded, ``eligible`` = groups in the pool):

- **sample** of ``k`` groups is granted when ``size >= min_size_to_sample``, ``eligible >= k`` and
  ``diff - 1 >= min_diff`` (the first group of the batch fits; a batch may overshoot by ``k - 1``,
  as a Reverb batch of ``k`` items sampled one by one would).
- **insert** is granted when ``size < min_size_to_sample`` (Reverb: filling up never waits), or
  ``diff + s <= max_diff`` (the first group fits), or when no sampler could make progress anyway:
  ``eligible`` is smaller than the largest batch a sampler is waiting for. That last escape is what
  keeps a stale-dropped or fully leased pool from blocking the inserts it needs.

Liveness: with ``error_buffer >= max(1, s)`` (validated in the config) ``max_diff - min_diff >= 1 + s``,
so for every ``diff`` at least one of "first group fits" holds; together with the escapes, whenever
both a sampler and an inserter wait, one of them is granted.

Restore (the Reverb #14/#64/#118/#147 family: a restored table that hangs samplers or inserters):
``size`` and ``eligible`` are never restored counters — they are read from the restored contents —
and ``load_state_dict`` re-bases a ``diff`` that falls outside the window of the *current* config
(e.g. ``samples_per_insert`` changed between runs) to the nearest edge, so no restored state owes
the other side more work than the live limiter ever could.
"""

from __future__ import annotations

from gyre.replay.config import RateLimiterConfig


class RateLimitedError(TimeoutError):
    """An insert or sample waited for the rate limiter longer than its timeout; the message says why."""


class RateLimiter:
    """Decides whether an insert or a sample may proceed now; the buffer waits and retries.

    Args:
        config: ratio, window and minimum size.
    """

    def __init__(self, config: RateLimiterConfig) -> None:
        self.config = config
        self.inserted = 0
        """Groups inserted (accepted into the pool) over the buffer's lifetime."""
        self.sampled = 0
        """Groups leased; a release or an expired lease gives its groups back."""
        spi = config.samples_per_insert
        if spi is None:
            self._min_diff, self._max_diff = float("-inf"), float("inf")
        else:
            err = config.error_buffer if config.error_buffer is not None else max(1.0, spi)
            self._min_diff = spi * config.min_size_to_sample - err
            self._max_diff = spi * config.min_size_to_sample + err

    @property
    def diff(self) -> float:
        """``samples_per_insert * inserted - sampled`` (0 without a ratio)."""
        spi = self.config.samples_per_insert
        return 0.0 if spi is None else spi * self.inserted - self.sampled

    def can_sample(self, k: int, size: int, eligible: int) -> bool:
        """Whether a lease of ``k`` groups may be granted now."""
        if size < self.config.min_size_to_sample or eligible < k:
            return False
        return self.diff - 1 >= self._min_diff

    def can_insert(self, size: int, eligible: int, waiting_k: int) -> bool:
        """Whether an insert may proceed now; ``waiting_k``: largest batch a sampler waits for (0: none)."""
        if size < self.config.min_size_to_sample:
            return True
        spi = self.config.samples_per_insert
        if spi is None or self.diff + spi <= self._max_diff:
            return True
        return eligible < max(waiting_k, 1)

    def why_not_insert(self) -> str:
        """Human-readable reason an insert is waiting (for errors and logs)."""
        return (f"rate limiter: diff {self.diff:.1f} + samples_per_insert {self.config.samples_per_insert} "
                f"exceeds max_diff {self._max_diff:.1f} (inserted {self.inserted}, sampled {self.sampled}); "
                "waiting for samples")

    def on_insert(self, groups: int) -> None:
        self.inserted += groups

    def on_sample(self, groups: int) -> None:
        self.sampled += groups

    def on_unsample(self, groups: int) -> None:
        """A lease was released or expired: its groups were not consumed."""
        self.sampled -= groups

    def state_dict(self) -> dict:
        return {"inserted": self.inserted, "sampled": self.sampled}

    def load_state_dict(self, state: dict) -> None:
        """Restore counters, re-basing ``diff`` into ``[min_diff, max_diff]`` of the current config."""
        self.inserted, self.sampled = int(state["inserted"]), int(state["sampled"])
        spi = self.config.samples_per_insert
        if spi is None:
            return
        if self.diff > self._max_diff:
            self.sampled = int(-(-(spi * self.inserted - self._max_diff) // 1))  # ceil: diff <= max_diff
        elif self.diff < self._min_diff:
            self.sampled = int((spi * self.inserted - self._min_diff) // 1)  # floor: diff >= min_diff

    def info(self) -> dict:
        """Counters and window (the window is reported as 0, 0 without a ratio)."""
        ratio = self.config.samples_per_insert is not None
        return {"rl_inserted": self.inserted, "rl_sampled": self.sampled, "rl_diff": self.diff,
                "rl_min_diff": self._min_diff if ratio else 0.0, "rl_max_diff": self._max_diff if ratio else 0.0}
