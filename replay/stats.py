"""Windowed event rates for Info and metrics (inserts/s, samples/s)."""

from __future__ import annotations

import time
from collections import deque


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
