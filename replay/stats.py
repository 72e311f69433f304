"""Windowed event rates and latencies for Info and metrics (inserts/s, samples/s, RPC latency quantiles)."""

from __future__ import annotations

import time
from collections import deque

import numpy as np


class RateWindow:
    """Events per second over the last ``window_s`` seconds (monotonic time)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s, self._events = window_s, deque()

    def add(self, n: int) -> None:
        now = time.monotonic()
        self._events.append((now, n))
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def per_s(self) -> float:
        now = time.monotonic()
        return sum(n for t, n in self._events if t >= now - self.window_s) / self.window_s


class LatencyWindow:
    """The last ``size`` latencies of one kind of request (seconds), for their quantiles."""

    def __init__(self, size: int = 4096) -> None:
        self._seconds: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._seconds.append(seconds)

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (0..1) of the window's latencies, seconds; 0.0 while it is empty."""
        return float(np.quantile(np.fromiter(self._seconds, float), q)) if self._seconds else 0.0
