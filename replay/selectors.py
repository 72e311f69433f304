"""Selectors: which pooled groups a sample takes (and which group capacity eviction removes).

A selector holds the keys of the groups currently in the pool (a key is a group's insertion sequence
number, so smaller is older) and picks ``k`` distinct keys without removing them; the buffer then
moves the picked groups out of the pool. All operations are O(log n) or O(k), independent of how many
groups are stored, so sample latency stays flat in buffer size:

- ``FifoSelector`` / ``RecencySelector``: a heap of keys with lazy deletion; pick pops the ``k``
  oldest (newest) live keys and pushes them back, O(k log n).
- ``UniformSelector``: a dense list with swap-remove, O(1) add/remove, O(k) pick.
- ``PrioritizedSelector``: a sum tree over ``priority ** exponent``, O(log n) add/remove/update and
  O(k log n) pick without replacement.

Selectors are not thread-safe (the buffer's lock guards them) and keep no state that needs
persisting: they are rebuilt from the stored groups on restore, and the keys a sample picked are
written to the WAL rather than re-drawn.
"""

from __future__ import annotations

import heapq
import math
import random
from abc import ABC, abstractmethod


class Selector(ABC):
    """A set of pooled group keys that can pick ``k`` of them."""

    def __init__(self) -> None:
        self._live: set[int] = set()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: int) -> bool:
        return key in self._live

    def add(self, key: int, priority: float = 1.0) -> None:
        """Put ``key`` in the pool with ``priority`` (only ``prioritized`` uses it)."""
        if key in self._live:
            raise KeyError(f"group key {key} is already pooled")
        self._live.add(key)
        self._add(key, priority)

    def add_many(self, keys: list[int], priorities: list[float]) -> None:
        """``add`` for many keys at once (one insert's groups). Raises ``KeyError`` on a pooled key;
        then nothing is added."""
        fresh = set(keys)
        if len(fresh) != len(keys) or not self._live.isdisjoint(fresh):
            dup = next(k for i, k in enumerate(keys) if k in self._live or k in keys[:i])
            raise KeyError(f"group key {dup} is already pooled")
        self._live |= fresh
        add = self._add
        for key, priority in zip(keys, priorities):
            add(key, priority)

    def remove(self, key: int) -> None:
        """Take ``key`` out of the pool. Raises ``KeyError`` if it is not pooled."""
        self._live.remove(key)
        self._remove(key)

    def update(self, key: int, priority: float) -> None:
        """Change the priority of a pooled key (no-op for selectors that ignore priorities)."""

    def pick(self, k: int) -> list[int]:
        """``k`` distinct pooled keys in hand-out order. Raises ``ValueError`` if fewer are pooled."""
        if not 0 <= k <= len(self._live):
            raise ValueError(f"cannot pick {k} groups from a pool of {len(self._live)}")
        return self._pick(k) if k else []

    @abstractmethod
    def _add(self, key: int, priority: float) -> None: ...

    @abstractmethod
    def _remove(self, key: int) -> None: ...

    @abstractmethod
    def _pick(self, k: int) -> list[int]: ...


class FifoSelector(Selector):
    """Oldest inserted first (a released group goes back to its original place)."""

    _sign = 1

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[int] = []

    def _add(self, key: int, priority: float) -> None:
        heapq.heappush(self._heap, self._sign * key)

    def _remove(self, key: int) -> None:
        if len(self._heap) > 2 * len(self._live) + 64:  # compact the lazily deleted entries
            self._heap = [self._sign * k for k in self._live]
            heapq.heapify(self._heap)

    def _pick(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            key = self._sign * heapq.heappop(self._heap)
            if key in self._live and (not out or key != out[-1]):
                out.append(key)
        for key in out:
            heapq.heappush(self._heap, self._sign * key)
        return out


class RecencySelector(FifoSelector):
    """Newest inserted first."""

    _sign = -1


class UniformSelector(Selector):
    """Uniformly at random, without replacement within one pick."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self._rng = rng
        self._keys: list[int] = []
        self._index: dict[int, int] = {}

    def _add(self, key: int, priority: float) -> None:
        self._index[key] = len(self._keys)
        self._keys.append(key)

    def _remove(self, key: int) -> None:
        i = self._index.pop(key)
        last = self._keys.pop()
        if last != key:
            self._keys[i] = last
            self._index[last] = i

    def _pick(self, k: int) -> list[int]:
        return [self._keys[i] for i in self._rng.sample(range(len(self._keys)), k)]


class PrioritizedSelector(Selector):
    """Probability proportional to ``priority ** exponent`` (a sum tree; picks are without replacement)."""

    def __init__(self, rng: random.Random, exponent: float = 1.0) -> None:
        super().__init__()
        self._rng, self._exponent = rng, exponent
        self._cap = 1024
        self._tree = [0.0] * (2 * self._cap)  # node i has children 2i, 2i+1; leaves at [cap, 2cap)
        self._slot: dict[int, int] = {}
        self._key_at: list[int | None] = [None] * self._cap
        self._free: list[int] = list(range(self._cap - 1, -1, -1))

    def _weight(self, priority: float) -> float:
        if not (math.isfinite(priority) and priority >= 0):
            raise ValueError(f"priority ({priority}) must be finite and >= 0")
        return priority ** self._exponent if self._exponent != 1.0 else float(priority)

    def _set(self, slot: int, weight: float) -> None:
        i = slot + self._cap
        self._tree[i] = weight
        i //= 2
        while i:
            self._tree[i] = self._tree[2 * i] + self._tree[2 * i + 1]
            i //= 2

    def _grow(self) -> None:
        old = [(self._key_at[s], self._tree[s + self._cap]) for s in range(self._cap)]
        self._cap *= 2
        self._tree = [0.0] * (2 * self._cap)
        self._key_at = [None] * self._cap
        self._free = list(range(self._cap - 1, len(old) - 1, -1))
        for s, (key, w) in enumerate(old):
            self._key_at[s] = key
            self._tree[s + self._cap] = w
        for i in range(self._cap - 1, 0, -1):
            self._tree[i] = self._tree[2 * i] + self._tree[2 * i + 1]

    def _add(self, key: int, priority: float) -> None:
        weight = self._weight(priority)
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slot[key], self._key_at[slot] = slot, key
        self._set(slot, weight)

    def _remove(self, key: int) -> None:
        slot = self._slot.pop(key)
        self._key_at[slot] = None
        self._set(slot, 0.0)
        self._free.append(slot)

    def update(self, key: int, priority: float) -> None:
        if key not in self._live:
            raise KeyError(f"group key {key} is not pooled")
        self._set(self._slot[key], self._weight(priority))

    def _descend(self, u: float) -> int:
        i = 1
        while i < self._cap:
            left = self._tree[2 * i]
            if u < left or self._tree[2 * i + 1] <= 0.0:
                i = 2 * i
            else:
                u -= left
                i = 2 * i + 1
        return i - self._cap

    def _pick(self, k: int) -> list[int]:
        taken: list[tuple[int, float]] = []
        try:
            for _ in range(k):
                total = self._tree[1]
                if total <= 0.0:  # only zero-priority keys left: uniform among them
                    rest = [s for s in self._slot.values() if s not in {t for t, _ in taken}]
                    slot = self._rng.choice(rest)
                else:
                    slot = self._descend(self._rng.random() * total)
                    if self._key_at[slot] is None or self._tree[slot + self._cap] <= 0.0:
                        slot = max(self._slot.values(), key=lambda s: self._tree[s + self._cap])
                taken.append((slot, self._tree[slot + self._cap]))
                self._set(slot, 0.0)
        finally:
            for slot, weight in taken:
                self._set(slot, weight)
        return [self._key_at[s] for s, _ in taken]


def make_selector(name: str, rng: random.Random, exponent: float = 1.0) -> Selector:
    """Selector by config name (``fifo | uniform | prioritized | recency``). Raises ``ValueError``."""
    if name == "fifo":
        return FifoSelector()
    if name == "recency":
        return RecencySelector()
    if name == "uniform":
        return UniformSelector(rng)
    if name == "prioritized":
        return PrioritizedSelector(rng, exponent)
    raise ValueError(f"unknown selector {name!r}; expected fifo, uniform, prioritized or recency")
