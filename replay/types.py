"""The nouns of replay in one place: stored groups, insert splits, leases, results and counters.

Frozen dataclasses with a docstring per field (shapes are row counts; versions are policy versions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

POOLED, LEASED, EXCLUDED = "pooled", "leased", "excluded"


@dataclass(frozen=True)
class Group:
    """One stored GRPO group (all rows of one prompt attempt that arrived in one insert)."""

    key: int
    """Insertion sequence number, unique over the buffer's lifetime (smaller is older)."""
    group_id: str
    """``"{prompt_index}-{attempt}"``."""
    prompt_index: int
    oldest_version: int
    """Policy version of the oldest token in the group (min over rows of the first span)."""
    table: pa.Table
    """The group's rows, ``TRAJECTORY_SCHEMA``, ``[n]`` rows."""
    nbytes: int
    """Arrow bytes of ``table``."""
    state: str = POOLED
    """``pooled | leased | excluded``."""
    times_sampled: int = 0
    """Leases that included this group and were not released or expired."""
    priority: float = 1.0
    """Sampling priority for the ``prioritized`` selector."""
    source: tuple[pa.Table, int] | None = None
    """``(table, row offset)`` when ``table`` is a zero-copy slice of a larger table (the insert it came
    in, or the snapshot it was restored from); lets a snapshot write runs of groups without copying."""


@dataclass(frozen=True)
class GroupRows:
    """One group of an insert, split and checked before the buffer's lock is taken."""

    group_id: str
    prompt_index: int
    oldest_version: int
    """min over rows of the first span's version."""
    table: pa.Table
    """``[n]`` rows of ``TRAJECTORY_SCHEMA``."""
    nbytes: int
    """Arrow bytes of the rows (the insert's bytes apportioned by row count)."""
    newest_versions: tuple[tuple[int, int], ...]
    """``(version of the last span, rows)`` pairs."""
    multi_version: int
    """Rows whose spans name two or more versions."""
    source: tuple[pa.Table, int] | None = None
    """``(insert table, row offset)`` when ``table`` is a zero-copy slice of it."""


class UnknownLeaseError(KeyError):
    """Ack/Release named a lease id the buffer does not hold."""


@dataclass(frozen=True)
class Lease:
    """Groups handed to one consumer until ack, release or ``expires_at`` (clock seconds)."""

    lease_id: str
    keys: tuple[int, ...]
    consumer: str
    expires_at: float


@dataclass
class InsertResult:
    accepted: int = 0
    """Rows newly stored (pooled or excluded)."""
    duplicates: int = 0
    """Rows of groups whose prompt was already complete (a retry, or a late attempt)."""
    dropped_stale: int = 0
    """Rows too stale at insert (dropped, or stored excluded under ``staleness_mode="exclude"``)."""


@dataclass
class Counters:
    """Lifetime counters (persisted in snapshots; rebuilt by WAL replay)."""

    inserted_total: int = 0
    duplicates_total: int = 0
    dropped_stale_total: int = 0
    excluded_stale_total: int = 0
    evicted_groups_total: int = 0
    sampled_groups_total: int = 0
    acked_groups_total: int = 0
    consumed_groups_total: int = 0
    released_groups_total: int = 0
    expired_groups_total: int = 0
    inserted_multi_version: int = 0
    inserted_by_newest_version: dict[int, int] = field(default_factory=dict)
    staleness_at_sample: dict[int, int] = field(default_factory=dict)
    """Policy lag (learner version − oldest token version) → groups sampled at that lag."""


class SnapshotError(ValueError):
    """A snapshot that cannot be used; the message names the snapshot, the file and the check."""
