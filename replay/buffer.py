"""In-memory Arrow trajectory buffer: whole-group FIFO sampling, staleness gate, leases.

Thread-safe; used in-process by tests and behind ``services.replay_server`` in production.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from proto.trajectory import SchemaError, validate_table
from replay.config import ReplayConfig
from replay.ledger import PromptLedger


class UnknownLeaseError(KeyError):
    """Ack/Release named a lease id the buffer does not hold."""


@dataclass
class _Group:
    table: pa.Table
    oldest_version: int
    """Policy version of the oldest token in the group (min over rows of the first span)."""


@dataclass
class _Lease:
    group_ids: list[str]
    expires_at: float
    consumer: str


@dataclass
class InsertResult:
    accepted: int = 0
    duplicates: int = 0
    dropped_stale: int = 0


@dataclass
class BufferCounters:
    inserted_total: int = 0
    duplicates_total: int = 0
    dropped_stale_total: int = 0
    evicted_groups_total: int = 0
    sampled_groups_total: int = 0
    acked_groups_total: int = 0
    staleness_at_sample: list[int] = field(default_factory=list)
    inserted_by_newest_version: dict[int, int] = field(default_factory=dict)
    inserted_multi_version: int = 0


class TrajectoryBuffer:
    """Stores GRPO groups as Arrow tables and leases them out whole, oldest first.

    Args:
        config: capacity, staleness and lease settings.
        clock: monotonic clock in seconds (injectable for tests).
    """

    def __init__(self, config: ReplayConfig, clock=time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Condition()
        self._ready: OrderedDict[str, _Group] = OrderedDict()
        self._leased: dict[str, _Group] = {}
        self._leases: dict[str, _Lease] = {}
        self._seen_ids: set[str] = set()
        self._learner_version = -1
        self.ledger = PromptLedger(config.num_prompts, clock)
        self.counters = BufferCounters()

    # ---- insert -------------------------------------------------------------------------------
    def insert(self, table: pa.Table) -> InsertResult:
        """Store the whole groups in ``table`` (validated; rows already seen count as duplicates).

        Raises:
            SchemaError: the table does not match the trajectory schema; nothing is stored.
        """
        validate_table(table)
        result = InsertResult()
        groups = table.column("group_id").to_pylist()
        with self._lock:
            for group_id in dict.fromkeys(groups):
                rows = table.filter(pc.equal(table.column("group_id"), group_id))
                self._insert_group(group_id, rows, result)
            self.counters.inserted_total += result.accepted
            self.counters.duplicates_total += result.duplicates
            self.counters.dropped_stale_total += result.dropped_stale
            self._lock.notify_all()
        return result

    def _insert_group(self, group_id: str, rows: pa.Table, result: InsertResult) -> None:
        ids = rows.column("trajectory_id").to_pylist()
        prompt_indices = set(rows.column("prompt_index").to_pylist())
        if len(prompt_indices) != 1:
            raise SchemaError(f"group {group_id!r} mixes prompt indices {sorted(prompt_indices)}")
        prompt_index = prompt_indices.pop()
        if any(i in self._seen_ids for i in ids) or self.ledger.is_complete(prompt_index):
            result.duplicates += len(ids)
            return
        oldest = min(spans[0] for spans in rows.column("version_span_versions").to_pylist())
        self._seen_ids.update(ids)
        self.ledger.complete(prompt_index)
        if self._too_stale(oldest):
            result.dropped_stale += len(ids)
            return
        self._ready[group_id] = _Group(rows, oldest)
        result.accepted += len(ids)
        for spans in rows.column("version_span_versions").to_pylist():
            by_version = self.counters.inserted_by_newest_version
            by_version[spans[-1]] = by_version.get(spans[-1], 0) + 1
            self.counters.inserted_multi_version += len(set(spans)) > 1
        while len(self._ready) + len(self._leased) > self.config.capacity_groups and self._ready:
            self._ready.popitem(last=False)
            self.counters.evicted_groups_total += 1

    def _too_stale(self, oldest_version: int) -> bool:
        return self._learner_version - oldest_version > self.config.max_staleness

    # ---- sample / leases ----------------------------------------------------------------------
    def sample(
        self, num_groups: int, learner_version: int, timeout_s: float = 0.0, consumer: str = ""
    ) -> tuple[str, pa.Table] | None:
        """Lease the ``num_groups`` oldest eligible groups; wait up to ``timeout_s`` seconds for them.

        Groups whose policy lag against ``learner_version`` exceeds ``max_staleness`` are dropped.
        Returns ``(lease_id, table)`` with ``num_groups * group_size`` rows, or ``None`` on timeout.
        """
        if num_groups < 1:
            raise ValueError(f"num_groups ({num_groups}) must be >= 1")
        deadline = self._clock() + max(timeout_s, 0.0)
        with self._lock:
            self._learner_version = max(self._learner_version, learner_version)
            while True:
                self._expire_leases()
                self._drop_stale()
                if len(self._ready) >= num_groups:
                    break
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return None
                self._lock.wait(timeout=min(remaining, 1.0))
            picked = list(itertools.islice(self._ready, num_groups))
            groups = [self._ready.pop(g) for g in picked]
            self._leased.update(zip(picked, groups))
            lease_id = uuid.uuid4().hex
            self._leases[lease_id] = _Lease(picked, self._clock() + self.config.lease_ttl_s, consumer)
            self.counters.sampled_groups_total += len(picked)
            self.counters.staleness_at_sample.extend(learner_version - g.oldest_version for g in groups)
            table = pa.concat_tables([g.table for g in groups])
        return lease_id, table

    def ack(self, lease_ids: list[str]) -> int:
        """Mark leased groups consumed; returns how many groups. Raises ``UnknownLeaseError``."""
        with self._lock:
            self._check_leases(lease_ids)
            n = 0
            for lease_id in lease_ids:
                for g in self._leases.pop(lease_id).group_ids:
                    self._leased.pop(g, None)
                    n += 1
            self.counters.acked_groups_total += n
            return n

    def release(self, lease_ids: list[str]) -> int:
        """Return leased groups to the front of the pool; returns how many groups."""
        with self._lock:
            self._check_leases(lease_ids)
            n = sum(self._return_lease(lease_id) for lease_id in lease_ids)
            self._lock.notify_all()
            return n

    def _check_leases(self, lease_ids: list[str]) -> None:
        for lease_id in lease_ids:
            if lease_id not in self._leases:
                raise UnknownLeaseError(f"unknown lease id {lease_id!r}")

    def _return_lease(self, lease_id: str) -> int:
        lease = self._leases.pop(lease_id)
        for g in reversed(lease.group_ids):
            self._ready[g] = self._leased.pop(g)
            self._ready.move_to_end(g, last=False)
        return len(lease.group_ids)

    def _expire_leases(self) -> None:
        now = self._clock()
        for lease_id in [i for i, lease in self._leases.items() if lease.expires_at <= now]:
            self._return_lease(lease_id)

    def _drop_stale(self) -> None:
        for g in [g for g, grp in self._ready.items() if self._too_stale(grp.oldest_version)]:
            n = self._ready.pop(g).table.num_rows
            self.counters.dropped_stale_total += n

    # ---- prompts / info -----------------------------------------------------------------------
    def lease_prompts(self, consumer: str, count: int, ttl_s: float | None = None) -> list[tuple[int, int]]:
        """Lease prompt indices for a rollout; see ``PromptLedger.lease``."""
        with self._lock:
            return self.ledger.lease(consumer, count, ttl_s or self.config.prompt_lease_ttl_s)

    def info(self) -> dict[str, int]:
        """Plain counters for the Info RPC and metrics."""
        with self._lock:
            c = self.counters
            return {
                "size_trajectories": sum(g.table.num_rows for g in self._ready.values()),
                "size_groups": len(self._ready),
                "inserted_total": c.inserted_total,
                "duplicates_total": c.duplicates_total,
                "dropped_stale_total": c.dropped_stale_total,
                "sampled_groups_total": c.sampled_groups_total,
                "leased_groups": len(self._leased),
                "acked_groups_total": c.acked_groups_total,
                "prompts_completed": self.ledger.num_completed,
                "learner_version": self._learner_version,
                "inserted_by_newest_version": dict(c.inserted_by_newest_version),
                "inserted_multi_version": c.inserted_multi_version,
            }
