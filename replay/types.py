"""The nouns of replay in one place: stored groups, insert splits, leases, results and counters, and the
check of a sample request's arguments.

Frozen dataclasses with a docstring per field (shapes are row counts; versions are policy versions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

POOLED, LEASED, EXCLUDED = "pooled", "leased", "excluded"


@dataclass(frozen=True, slots=True)
class Group:
    """One stored GRPO group (all rows of one prompt attempt that arrived in one insert).

    The rows are not copied or sliced per group: a group points at the Arrow table it arrived in (the
    insert's one record batch, or the snapshot it was restored from) by row offset and count, so an
    insert of G groups keeps one table and G small records; ``table`` slices on demand (zero-copy).
    """

    key: int
    """Insertion sequence number, unique over the buffer's lifetime (smaller is older)."""
    group_id: str
    """``"{prompt_index}-{attempt}"``."""
    prompt_index: int
    oldest_version: int
    """Policy version of the oldest token in the group (min over rows of the first span)."""
    source: pa.Table
    """The table holding the group's rows contiguously (``TRAJECTORY_SCHEMA``)."""
    offset: int
    """Row of ``source`` where the group starts."""
    num_rows: int
    """``[n]`` rows of the group."""
    nbytes: int
    """Arrow bytes of the rows (the source's bytes apportioned by row count)."""
    state: str = POOLED
    """``pooled | leased | excluded``."""
    times_sampled: int = 0
    """Leases that included this group and were not released or expired."""
    priority: float = 1.0
    """Sampling priority for the ``prioritized`` selector."""

    @property
    def table(self) -> pa.Table:
        """The group's ``[num_rows]`` rows, a zero-copy slice of ``source``."""
        return self.source.slice(self.offset, self.num_rows)


@dataclass(frozen=True)
class InsertPlan:
    """An insert, validated and split into groups before the buffer's lock is taken (columnar: one
    entry per group in each list, in first-appearance order)."""

    table: pa.Table
    """The insert's rows with every group contiguous (the client's table, or one reordered copy)."""
    group_ids: list[str]
    prompt_index: list[int]
    oldest_version: list[int]
    """min over the group's rows of the first span's version."""
    offset: list[int]
    """First row of each group in ``table``."""
    num_rows: list[int]
    nbytes: list[int]
    """Arrow bytes of each group (the insert's bytes apportioned by row count)."""
    newest_versions: list[tuple[tuple[int, int], ...]]
    """Per group: ``(version of the last span, rows)`` pairs."""
    multi_version: list[int]
    """Per group: rows whose spans name two or more versions."""
    sources: list[pa.Table] | None = None
    """Per group, the table its ``offset`` points into when the plan covers several inserts
    (``split_batch``: each group keeps its own insert's table); ``None``: ``table`` for every group."""
    part: list[int] | None = None
    """Per group, the index of the insert it came from (``split_batch``); ``None``: one insert."""
    parts: int = 1
    """Inserts the plan covers."""
    timeline: list[int] | None = None
    """Per group: the ``policy_timeline`` of its rows (their largest), ``proto.timeline``."""
    newest: list[int] | None = None
    """Per group: the newest version any of its rows' spans names."""

    def __len__(self) -> int:
        return len(self.group_ids)


class UnknownLeaseError(KeyError):
    """Ack/Release named a lease id the buffer does not hold."""


@dataclass(frozen=True)
class Lease:
    """Groups handed to one consumer until ack, release or ``expires_at`` (clock seconds)."""

    lease_id: str
    keys: tuple[int, ...]
    consumer: str
    expires_at: float
    request_id: str = ""
    """The ``Sample`` request's idempotency key ("" when it sent none): a retry of it gets this lease again."""


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
    dead_timeline_total: int = 0
    """Rows dropped because a crashed learner's timeline sampled them after the version the current learner
    resumed from (``ReplayState.dead``); also counted in ``dropped_stale_total``."""
    dead_timeline_deleted_total: int = 0
    """The part of ``dead_timeline_total`` deleted after it was stored (at a ``Rejoin``, or a lease's return)."""
    inserted_by_newest_version: dict[int, int] = field(default_factory=dict)
    staleness_at_sample: dict[int, int] = field(default_factory=dict)
    """Policy lag (learner version − oldest token version) → groups sampled at that lag."""


class SnapshotError(ValueError):
    """A snapshot that cannot be used; the message names the snapshot, the file and the check."""


MAX_REQUEST_ID = 128
"""Longest ``Sample`` idempotency key (characters); a uuid4 hex is 32."""


def checked_sample_args(num_groups: int, prompt_indices, request_id: str) -> list[int] | None:
    """``prompt_indices`` as ints after checking ``sample``'s arguments; raises ``ValueError`` naming the bad one."""
    if num_groups < 1:
        raise ValueError(f"num_groups ({num_groups}) must be >= 1")
    if len(request_id) > MAX_REQUEST_ID:
        raise ValueError(f"request_id is {len(request_id)} characters; at most {MAX_REQUEST_ID} allowed")
    if prompt_indices is None:
        return None
    prompt_indices = [int(i) for i in prompt_indices]
    if len(prompt_indices) != num_groups or len(set(prompt_indices)) != num_groups or min(prompt_indices) < 0:
        raise ValueError(f"prompt_indices {prompt_indices[:8]} must be num_groups ({num_groups}) distinct indices >= 0")
    return prompt_indices
