"""Replay service configuration: one pydantic class per component, validated at construction.

``ReplayConfig`` is the ``replay:`` section of a recipe. Durability is off unless ``dir`` is set; the
WAL, snapshot and rate-limiter parts are nested sections with their own defaults.
"""

from __future__ import annotations

import math

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SelectorName = Literal["fifo", "uniform", "prioritized", "recency"]
"""``fifo``: oldest inserted first. ``uniform``: uniformly at random. ``prioritized``: with probability
``priority ** priority_exponent / sum``. ``recency``: newest inserted first."""


class WalConfig(BaseModel):
    """Write-ahead log: how inserts and state changes become durable before they are acknowledged."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    durability: Literal["fsync", "write", "buffered"] = "fsync"
    """``fsync``: a record is written and fsync'd before its RPC answers (survives power loss).
    ``write``: written to the OS, not fsync'd (survives a process crash, not a machine crash).
    ``buffered``: answered once queued in process memory and written every ``group_commit_ms``;
    loses acknowledged data on any crash — only for tests that must prove the crash checker works."""

    group_commit_ms: float = Field(0.0, ge=0, le=1000)
    """Milliseconds the log waits before an fsync so concurrent operations share it (0: fsync as soon
    as the previous one ends, which already batches whatever arrived meanwhile)."""

    segment_bytes: int = Field(64 * 1024 * 1024, ge=4096)
    """A segment is closed and a new one started once it holds at least this many bytes."""

    compression: Literal["none", "zstd"] = "none"
    """Buffer compression of insert payloads in the WAL. ``none`` appends the client's Arrow IPC bytes
    as they arrived (no copy, no CPU beyond a CRC-32C), which keeps ingest near the network's speed;
    ``zstd`` spends ~1 ms of CPU per 0.5 MB message (at level 1) for ~30% less disk on random token
    ids. Arrow IPC records the compression per batch, so a log written either way reads back alike."""

    drop_page_cache: bool = True
    """Drop the log from the OS page cache once fsync'd (``POSIX_FADV_DONTNEED`` after each group
    commit with ``durability="fsync"``; the other modes fsync only at close): the WAL is read again only
    by a restore, and it grows by every inserted byte. ``False`` keeps it cached."""

    zstd_level: int = Field(1, ge=-7, le=22)
    """zstd level with ``compression="zstd"`` (1: ~1 GB/s per core; negative levels are faster and
    compress less)."""

    keep_segments: bool = False
    """Keep every WAL segment, also those a snapshot covers: the run's whole history (every insert, lease and
    ack) stays on disk, so the run can be a recording that other learners train from (``replay.source``,
    ``replay.recorded``). Disk then grows by every inserted byte. ``False``: once the oldest kept snapshot
    covers a segment it is deleted (a run whose snapshots deleted segments cannot be a recording)."""


class SnapshotConfig(BaseModel):
    """Snapshots: compacted copies of the live set that let restore skip most of the WAL."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    interval_s: float | None = Field(300.0, gt=0)
    """Seconds between periodic snapshots; ``None`` snapshots only on request (the Snapshot RPC)."""

    wal_bytes: int | None = Field(1024 * 1024 * 1024, ge=4096)
    """Also snapshot once the WAL written since the last snapshot exceeds this many bytes."""

    keep: int = Field(2, ge=1)
    """Snapshots kept; WAL segments older than the oldest kept one are deleted."""

    busy_pause_ms: float = Field(1.0, ge=0, le=100)
    """Milliseconds each background step of a snapshot (an Arrow batch written, a 1 MiB range hashed or
    written back, a chunk of an old file truncated) sleeps while the server is busy with inserts, so the
    snapshot yields the cores and the GIL to them (``replay.files.ForegroundGate``); an idle server's
    snapshot does not pause. 0: never pause (fastest snapshots, slowest inserts meanwhile)."""

    drop_page_cache: bool = True
    """Drop the snapshot's Arrow files from the OS page cache as they are written back
    (``POSIX_FADV_DONTNEED``, ``replay.files.HashingFile``): a snapshot is read again only by a
    restore, and caching several GB of it per snapshot fills memory until reclaim slows everything
    (``bench.replay`` at 1M stored trajectories: insert p99 during snapshots 11.0-11.1 ms with the
    cache kept, 8.4-8.8 ms dropped). ``False`` keeps them cached: a restart soon after reads them from
    memory (restore ~1 s/GB here instead of 1.8-2.2 s/GB from disk)."""

    compression: Literal["none", "lz4", "zstd"] = "none"
    """Buffer compression of the snapshot's Arrow files. ``none`` writes at disk speed and restores
    without decompressing; ``zstd`` takes ~5x the CPU for ~30% less disk on random token ids (more on
    real text). The WAL has its own ``wal.compression``."""


class RateLimiterConfig(BaseModel):
    """Samples-per-insert rate limiter with Reverb's semantics, counted in groups.

    With ``samples_per_insert = s`` and ``error_buffer = e``, ``diff = s * inserted - sampled`` is kept
    in ``[s * min_size_to_sample - e, s * min_size_to_sample + e]``: a sample waits while it would push
    ``diff`` below the window, an insert waits while it would push it above. ``samples_per_insert = None``
    is Reverb's ``MinSize``: only ``min_size_to_sample`` applies.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_size_to_sample: int = Field(1, ge=1)
    """Groups that must be stored (pooled or leased) before any sample is granted."""

    samples_per_insert: float | None = Field(None, gt=0)
    """Target number of group samples per group inserted; ``None`` disables the ratio."""

    error_buffer: float | None = Field(None, gt=0)
    """Half-width of the allowed ``diff`` window (groups); default ``max(1, samples_per_insert)``.
    Must be at least ``max(1, samples_per_insert)`` so that one side can always proceed."""

    @model_validator(mode="after")
    def _check(self) -> "RateLimiterConfig":
        if self.samples_per_insert is not None and self.error_buffer is not None:
            least = max(1.0, self.samples_per_insert)
            if self.error_buffer < least:
                raise ValueError(f"error_buffer ({self.error_buffer}) must be >= max(1, samples_per_insert) "
                                 f"= {least}, or inserts and samples can block each other forever")
        return self


class RecordedSource(BaseModel):
    """Where a run's trajectories come from when it trains from a recording instead of live rollouts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    recorded: str
    """Directory of a finished run (``runs/NAME``, holding its ``recipe.json`` and replay directory) whose learner's
    consumed groups this run trains on, in the order that learner acknowledged them (``replay.recorded``). Relative
    paths resolve from where gyre runs. The recording is only read; this run's replay gets a copy of its own."""

    @field_validator("recorded")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("expected the directory of a recorded run, e.g. runs/my-run; got an empty path")
        return str(Path(value).expanduser().resolve())


class ReplayConfig(BaseModel):
    """How replay stores, gates, hands out and persists trajectories."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_staleness: int = Field(2, ge=0)
    """Largest policy lag allowed: a group whose oldest token came from version ``v`` is only handed
    to a learner at version ``L`` if ``L - v <= max_staleness``."""

    groups_per_step: int | None = Field(None, ge=1)
    """The learner's groups per step (``gyre run`` sets it from ``learner.groups_per_step``): the unit of the fleet's
    work budget. ``None``: no budget (prompts are leased while any rollout asks)."""

    work_budget_margin_steps: float = Field(0.0, ge=0)
    """Steps of groups the work budget holds beyond ``max_staleness`` steps (``work_budget``). Each one is a step of
    groups that, when the budget binds, waits a step longer than the staleness gate allows and is dropped; raise it
    only when the learner waits for data with the fleet held at the budget."""

    staleness_mode: Literal["drop", "exclude"] = "drop"
    """What happens to a group that became too stale: ``drop`` deletes it; ``exclude`` keeps it stored
    (counted, snapshotted, evicted first) but never hands it out again."""

    selector: SelectorName = "fifo"
    """Which pooled groups a sample leases."""

    eviction: Literal["fifo", "uniform", "recency"] = "fifo"
    """Which pooled group is evicted when ``capacity_groups`` is exceeded (excluded groups go first;
    leased groups are never evicted)."""

    priority_exponent: float = Field(1.0, ge=0)
    """``prioritized`` selector: sampling probability is proportional to ``priority ** exponent``."""

    default_priority: float = Field(1.0, gt=0)
    """Priority of a newly inserted group until the UpdatePriorities RPC changes it."""

    max_times_sampled: int = Field(1, ge=1)
    """A group is deleted once it has been acknowledged this many times; below that an ack returns it
    to the pool for reuse."""

    capacity_groups: int = Field(4096, ge=1)
    """Most groups held at once (pooled + leased + excluded); inserts beyond it evict (see ``eviction``)."""

    max_batch_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    """Largest Arrow IPC payload accepted in one insert (bytes)."""

    lease_ttl_s: float = Field(600.0, gt=0)
    """Seconds before an unacknowledged sample lease returns its groups to the pool."""

    prompt_lease_ttl_s: float = Field(300.0, gt=0)
    """Seconds before an uncompleted prompt lease is re-issued to another rollout."""

    num_prompts: int | None = Field(None, ge=1)
    """Size of the prompt stream; ``None`` means unbounded."""

    shards: int = Field(1, ge=1)
    """Replay processes the run's replay is split into. Prompt ``i`` belongs to shard ``i mod shards``: its leases,
    its group and its completion live there, in that shard's own WAL, snapshots and ledger (``{dir}/shard-{k}``
    when ``shards > 1``). Rollouts lease from and insert into the shards; the learner samples whole groups across
    them (``services.common.replay_shards``). ``capacity_groups`` and the rate limiter hold per shard; the work
    budget is split between them. 1: one replay, exactly as without sharding."""

    shard: int = Field(0, ge=0)
    """Which shard this replay process is, ``0 <= shard < shards`` (``gyre run`` sets it per process)."""

    rate_limiter: RateLimiterConfig = RateLimiterConfig()
    """Samples-per-insert limiter and minimum size; the default only needs one stored group."""

    insert_timeout_s: float = Field(60.0, gt=0)
    """Longest an in-process insert waits for the rate limiter before ``RateLimitedError``
    (the gRPC server uses the call's deadline instead, when it is shorter)."""

    seed: int | None = None
    """Seed of the uniform/prioritized selectors and uniform eviction (``None``: from the OS)."""

    dir: str | None = None
    """Directory of the WAL and snapshots; ``None`` keeps everything in memory (lost on exit)."""

    wal: WalConfig = WalConfig()
    """Write-ahead log settings (used only with ``dir``)."""

    snapshot: SnapshotConfig = SnapshotConfig()
    """Snapshot settings (used only with ``dir``)."""

    source: RecordedSource | None = None
    """``None``: the rollouts generate the training groups (the usual run). ``{recorded: RUN_DIR}``: record once,
    train many — at start this run's replay is filled with a copy of the groups a recorded run's learner consumed,
    in that order; rollouts generate nothing (they run only for evaluation) and the learner takes the groups first
    in, first out, whatever its policy version: replay's staleness gate (``max_staleness``) is not applied. The run
    ends when ``learner.num_steps`` steps are done or the recording is used up, whichever comes first. Needs the
    defaults of ``selector``, ``max_times_sampled`` and ``rate_limiter``, which would change what is consumed."""

    @property
    def work_budget(self) -> int | None:
        """Most groups the fleet may have ready in replay or leased for generation at once:
        ``ceil(max(max_staleness + work_budget_margin_steps, 1) × groups_per_step)``, AReaL's staleness-bounded
        rollout budget (arXiv 2505.24298) counted from the rollouts' weights: a group leased now waits behind at most
        that many others, so the learner samples it within ``max_staleness`` steps, while the rollout generating it
        holds weights about one version behind the learner's — its lag stays within the gate. (With ``max_staleness
        + 1`` steps, as first built, `bench.fleet` dropped 17–26% of its groups at 16 rollouts.) With ``shards > 1``
        each shard holds its share (rounded up). ``None`` without ``groups_per_step``."""
        if self.groups_per_step is None:
            return None
        steps = max(self.max_staleness + self.work_budget_margin_steps, 1.0)
        fleet = math.ceil(steps * self.groups_per_step)
        return math.ceil(fleet / self.shards)

    def work_budget_at(self, lag: int) -> int | None:
        """``work_budget`` for a rollout whose weights trail the learner by ``lag`` versions: its groups start that
        much staler, so ``lag`` steps fewer (at least one step while ``lag <= max_staleness``; 0 past it, when all it
        generated would be dropped). ``None`` without ``groups_per_step``."""
        if self.groups_per_step is None:
            return None
        if lag > self.max_staleness:
            return 0
        steps = max(self.max_staleness + self.work_budget_margin_steps - max(lag, 0), 1.0)
        return math.ceil(math.ceil(steps * self.groups_per_step) / self.shards)

    @model_validator(mode="after")
    def _shard_in_range(self) -> "ReplayConfig":
        if self.shard >= self.shards:
            raise ValueError(f"replay.shard ({self.shard}) must be below replay.shards ({self.shards})")
        if self.shards > 1 and self.source is not None:
            raise ValueError(f"replay.shards ({self.shards}) must be 1 with replay.source: a recording is replayed "
                             "by one replay, in its recorded order")
        return self

    @model_validator(mode="after")
    def _recorded_order(self) -> "ReplayConfig":
        if self.source is None:
            return self
        limiter = self.rate_limiter.model_dump(exclude_defaults=True)
        changed = {"selector": (self.selector, "fifo", "'fifo'"), "max_times_sampled": (self.max_times_sampled, 1, "1"),
                   "rate_limiter": (limiter, {}, "left at its defaults")}
        for key, (value, wanted, shown) in changed.items():
            if value != wanted:
                raise ValueError(f"replay.{key} ({value!r}) must be {shown} with replay.source: a run that trains "
                                 "from a recording takes its groups once each, in the recorded order")
        return self
