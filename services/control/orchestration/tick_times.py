"""How long the supervisor's ticks take: the last ticks' durations, for the run summary and ``gyre status``."""

from __future__ import annotations

from collections import deque

import numpy as np


class TickTimes:
    """Durations (seconds) of the last ``size`` supervisor ticks."""

    def __init__(self, size: int = 10_000) -> None:
        self._seconds: deque[float] = deque(maxlen=size)
        self.count = 0
        """Ticks timed in all."""

    def add(self, seconds: float) -> None:
        self._seconds.append(seconds)
        self.count += 1

    def summary(self) -> dict:
        """``{"ticks", "tick_p50_s", "tick_p99_s", "tick_max_s"}`` over the window (zeros before the first tick)."""
        x = np.fromiter(self._seconds, float)
        q = (lambda p: round(float(np.quantile(x, p)), 4)) if len(x) else (lambda p: 0.0)
        return {"ticks": self.count, "tick_p50_s": q(0.5), "tick_p99_s": q(0.99),
                "tick_max_s": round(float(x.max()), 4) if len(x) else 0.0}
