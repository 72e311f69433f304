"""The replay state machine: every state change is one ``Record`` applied by ``ReplayState.apply``.

Live operations and WAL replay go through the same ``apply``, so a restored buffer is the buffer
that crashed. Applying a record is deterministic: everything random or time-dependent (which groups a
sample picks, which group capacity evicts, which leases expired) is decided by the caller and written
into the record. Not thread-safe and never waits; ``TrajectoryBuffer`` adds the lock, the waiting and
the WAL.
"""

from __future__ import annotations

import itertools
import random

import pyarrow as pa

from gyre.replay.config import ReplayConfig
from gyre.proto.timeline import SHARED
from gyre.proto.trajectory_upgrade import upgrade
from gyre.replay.groups import GroupStore, group_timeline, split_groups
from gyre.replay.ledger import PromptLedger
from gyre.replay.rate_limiter import RateLimiter
from gyre.replay.records import Record
from gyre.replay.types import EXCLUDED, LEASED, POOLED, Counters, Group, InsertPlan, InsertResult, Lease, UnknownLeaseError

ACKED_MEMORY = 4096
"""Acked lease ids remembered (in snapshots too) so that a repeated ack is answered 0, not NOT_FOUND."""


class ReplayState:
    """Stored groups, leases, ledger, limiter and counters, changed only through ``apply``.

    Args:
        config: replay settings.
        clock: seconds (wall clock by default, because deadlines are persisted).
        rng: random source of the selectors.
    """

    def __init__(self, config: ReplayConfig, clock, rng: random.Random) -> None:
        self.config, self._rng = config, rng
        self.store = GroupStore(config, rng)
        self.ledger = PromptLedger(config.num_prompts, clock, config.shard, config.shards)
        self.limiter = RateLimiter(config.rate_limiter)
        self.leases: dict[str, Lease] = {}
        self.acked_leases: dict[str, None] = {}
        """The last ``ACKED_MEMORY`` acked lease ids, oldest first: an ack repeated after a replay restart (the
        first was logged, its answer lost) is answered 0 instead of "unknown lease"."""
        self.learner_version = -1
        self.timeline = SHARED
        """Timeline (``proto.timeline``) of the learner that rejoined last; ``SHARED``: none declared one."""
        self.timeline_start = -1
        """Policy version that learner resumed from (``Rejoin``)."""
        self.retired: list[int] = []
        """Timelines of the learners that rejoined before it (crashed or replaced), oldest first."""
        self.next_key = 0
        self.counters = Counters()

    def reset(self) -> None:
        """Back to the empty state (after a snapshot failed to load half way)."""
        self.__init__(self.config, self.ledger._clock, self._rng)

    # ---- queries --------------------------------------------------------------------------------
    def too_stale(self, oldest_version: int) -> bool:
        return self.learner_version - oldest_version > self.config.max_staleness

    def dead(self, timeline: int, newest_version: int) -> bool:
        """Whether rows of ``timeline`` whose newest span is ``newest_version`` were sampled by weights that the
        current learner's history does not hold: a retired learner's versions above the one the current
        learner resumed from (they share a number, not the weights). A timeline replay never saw rejoin counts
        as live (a learner that has not rejoined yet, or ``SHARED``)."""
        return newest_version > self.timeline_start and timeline in self.retired

    @property
    def size(self) -> int:
        """Groups stored and not excluded (what ``min_size_to_sample`` counts)."""
        return self.store.count[POOLED] + self.store.count[LEASED]

    def can_sample(self, k: int) -> bool:
        return self.limiter.can_sample(k, self.size, self.store.count[POOLED])

    def can_insert(self, waiting_k: int) -> bool:
        return self.limiter.can_insert(self.size, self.store.count[POOLED], waiting_k)

    def eviction_keys(self, inserted: int = 0) -> list[int]:
        """Groups to evict now to get back under ``capacity_groups`` (never leased ones); the newest
        ``inserted`` groups are evicted only if nothing else can be."""
        over = len(self.store) - self.config.capacity_groups
        if over <= 0:
            return []
        return self.store.eviction_candidates(over, frozenset(range(self.next_key - inserted, self.next_key)))

    def lease_of_request(self, consumer: str, request_id: str) -> Lease | None:
        """The active lease that ``consumer``'s ``Sample`` with idempotency key ``request_id`` made, if any
        (a linear scan: a consumer holds a handful of leases)."""
        if not request_id:
            return None
        return next((x for x in self.leases.values() if x.request_id == request_id and x.consumer == consumer),
                    None)

    def check_leases(self, lease_ids: list[str], acked_ok: bool = False) -> None:
        """Raises ``UnknownLeaseError`` naming the first id not held (with ``acked_ok``: nor acked lately)."""
        for lease_id in lease_ids:
            if lease_id not in self.leases and not (acked_ok and lease_id in self.acked_leases):
                raise UnknownLeaseError(f"unknown lease id {lease_id!r}")

    def check(self, rec: Record) -> None:
        """Raise ``KeyError``/``ValueError`` if ``rec`` names groups or leases this state does not hold
        (restore uses it so that a record which cannot apply is refused before it changes anything)."""
        m = rec.meta
        if rec.kind == "evict":
            missing = [k for k in m["keys"] if k not in self.store.groups or self.store.groups[k].state == LEASED]
            if missing:
                raise KeyError(f"evict names groups {missing[:5]} that are not stored or are leased")
        elif rec.kind == "lease":
            if m["lease_id"] in self.leases:
                raise KeyError(f"lease id {m['lease_id']!r} already exists")
            bad = [k for k in m["keys"] if k not in self.store.sampler]
            if bad:
                raise KeyError(f"lease names groups {bad[:5]} that are not pooled")
        elif rec.kind in ("ack", "release", "expire"):
            self.check_leases(m["lease_ids"])
        elif rec.kind not in ("insert", "learner_version", "rejoin", "prompt_lease", "prompt_expire", "priority"):
            raise ValueError(f"unknown record kind {rec.kind!r}")

    # ---- transitions ----------------------------------------------------------------------------
    def apply(self, rec: Record, plan: InsertPlan | None = None):
        """Apply one record; ``plan`` is the already split insert (else parsed from the payload)."""
        m = rec.meta
        if rec.kind == "insert":
            if plan is None:
                plan = split_groups(upgrade(pa.ipc.open_stream(rec.payload).read_all(), "WAL insert record"),
                                    len(rec.payload))
            return self.insert_parts(plan)[0]
        if rec.kind == "evict":
            for key in m["keys"]:
                self.store.delete(key)
            self.counters.evicted_groups_total += len(m["keys"])
        elif rec.kind == "learner_version":
            self._set_learner_version(m["version"])
        elif rec.kind == "rejoin":
            return self._rejoin(m["consumer"], m["version"], m.get("timeline", SHARED))
        elif rec.kind == "lease":
            return self._lease(Lease(m["lease_id"], tuple(m["keys"]), m["consumer"], m["expires_at"],
                                     m.get("request_id", "")))
        elif rec.kind in ("ack", "release", "expire"):
            return self._end_leases(rec.kind, m["lease_ids"])
        elif rec.kind == "prompt_lease":
            self.ledger.apply_lease(m["consumer"], [tuple(x) for x in m["items"]], m["expires_at"])
        elif rec.kind == "prompt_expire":
            self.ledger.apply_expire([tuple(x) for x in m["items"]])
        elif rec.kind == "priority":
            for key, p in zip(m["keys"], m["priorities"]):
                if key in self.store.groups:
                    self.store.set_priority(key, p)
        return None

    def insert_parts(self, plan: InsertPlan) -> list[InsertResult]:
        """Store ``plan``'s groups (not logged here: the caller logged one WAL record per insert);
        returns one result per insert the plan covers (``plan.parts``), in order."""
        results, c, cfg = [InsertResult() for _ in range(plan.parts)], self.counters, self.config
        by_version, new = c.inserted_by_newest_version, []
        fresh = self.ledger.complete_many(plan.prompt_index)
        parts = plan.part or itertools.repeat(0)
        sources = plan.sources or itertools.repeat(plan.table)
        for i, (ok, group_id, prompt, oldest, n, part, source) in enumerate(zip(
                fresh, plan.group_ids, plan.prompt_index, plan.oldest_version, plan.num_rows, parts, sources)):
            result = results[part]
            if not ok:
                result.duplicates += n
                continue
            if plan.timeline is not None and self.dead(plan.timeline[i], plan.newest[i]):  # never stored
                result.dropped_stale += n
                c.dropped_stale_total += n
                c.dead_timeline_total += n
                continue
            stale = self.learner_version - oldest > cfg.max_staleness
            if stale:
                result.dropped_stale += n
                if cfg.staleness_mode == "drop":
                    c.dropped_stale_total += n
                    continue
                c.excluded_stale_total += n
            new.append(Group(self.next_key, group_id, prompt, oldest, source, plan.offset[i], n, plan.nbytes[i],
                             EXCLUDED if stale else POOLED, priority=cfg.default_priority))
            self.next_key += 1
            if stale:
                continue
            result.accepted += n
            for v, rows in plan.newest_versions[i]:
                by_version[v] = by_version.get(v, 0) + rows
            c.inserted_multi_version += plan.multi_version[i]
        self.store.add_many(new)
        self.limiter.on_insert(sum(g.state == POOLED for g in new))
        c.inserted_total += sum(r.accepted for r in results)
        c.duplicates_total += sum(r.duplicates for r in results)
        return results

    def _set_learner_version(self, version: int) -> None:
        self.learner_version = max(self.learner_version, version)
        for key in self.store.pooled_older_than(self.learner_version - self.config.max_staleness):
            self._stale(key)

    def _rejoin(self, consumer: str, version: int, timeline: int = SHARED) -> int:
        """``consumer`` resumed from a checkpoint at ``version``: the leases it still holds were taken after
        that checkpoint (its committed ones were acked first), so they go back to the pool; the learner
        version follows the checkpoint, down if need be (a learner rolled back to an older checkpoint
        must not see its fresh groups dropped as stale). A new ``timeline`` (not ``SHARED``) retires the
        previous learner's, and the stored groups that became ``dead`` are deleted. Returns how many groups
        were released."""
        if timeline != SHARED and timeline != self.timeline:
            if self.timeline != SHARED and self.timeline not in self.retired:
                self.retired.append(self.timeline)
            self.timeline, self.timeline_start = timeline, version
        held = [i for i, lease in self.leases.items() if lease.consumer == consumer]
        self.learner_version = version
        released = self._end_leases("release", held)
        self._set_learner_version(version)
        for key in [k for k, g in self.store.groups.items() if g.state != LEASED and self._group_dead(g)]:
            self._drop_dead(key)
        return released

    def _group_dead(self, g: Group) -> bool:
        return bool(self.retired) and self.dead(*group_timeline(g.table))

    def _drop_dead(self, key: int) -> None:
        rows = self.store.groups[key].num_rows
        self.store.delete(key)
        self.counters.dropped_stale_total += rows
        self.counters.dead_timeline_total += rows
        self.counters.dead_timeline_deleted_total += rows

    def _stale(self, key: int) -> None:
        rows = self.store.groups[key].num_rows
        if self.config.staleness_mode == "drop":
            self.store.delete(key)
            self.counters.dropped_stale_total += rows
        else:
            self.store.set_state(key, EXCLUDED)
            self.counters.excluded_stale_total += rows

    def _lease(self, lease: Lease) -> list[Group]:
        groups = [self.store.set_state(key, LEASED, sampled_delta=1) for key in lease.keys]
        self.leases[lease.lease_id] = lease
        self.limiter.on_sample(len(groups))
        c = self.counters
        c.sampled_groups_total += len(groups)
        for g in groups:
            lag = self.learner_version - g.oldest_version
            c.staleness_at_sample[lag] = c.staleness_at_sample.get(lag, 0) + 1
        return groups

    def _end_leases(self, how: str, lease_ids: list[str]) -> int:
        n = 0
        for lease_id in lease_ids:
            if how == "ack":
                self.acked_leases[lease_id] = None
                if len(self.acked_leases) > ACKED_MEMORY:
                    del self.acked_leases[next(iter(self.acked_leases))]
            for key in self.leases.pop(lease_id).keys:
                n += 1
                if how == "ack":
                    self._after_ack(key)
                else:
                    self.store.set_state(key, POOLED, sampled_delta=-1)
                    self.limiter.on_unsample(1)
                    if self._group_dead(self.store.groups[key]):
                        self._drop_dead(key)
                    elif self.too_stale(self.store.groups[key].oldest_version):
                        self._stale(key)
        c = self.counters
        if how == "ack":
            c.acked_groups_total += n
        elif how == "release":
            c.released_groups_total += n
        else:
            c.expired_groups_total += n
        return n

    def _after_ack(self, key: int) -> None:
        g = self.store.groups[key]
        if g.times_sampled >= self.config.max_times_sampled:
            self.store.delete(key)
            self.counters.consumed_groups_total += 1
        elif self.too_stale(g.oldest_version):
            self.store.set_state(key, POOLED)
            self._stale(key)
        else:
            self.store.set_state(key, POOLED)

    def work_budget_left(self, policy_version: int | None = None) -> int | None:
        """Groups the fleet may still lease: ``config.work_budget`` − groups ready − prompts leased (may be
        negative), or ``None`` without a budget. With ``policy_version`` (the asking rollout's weights) the budget
        counts its lag behind the learner (``config.work_budget_at``)."""
        lag = 0 if policy_version is None or self.learner_version < 0 else self.learner_version - policy_version
        cap = self.config.work_budget_at(lag)
        return None if cap is None else cap - self.store.count[POOLED] - self.ledger.num_leased

    def info(self) -> dict:
        """Sizes and lifetime counters as plain values."""
        store, c = self.store, self.counters
        return {
            "size_trajectories": store.rows[POOLED], "size_groups": store.count[POOLED],
            "stored_trajectories": sum(store.rows.values()), "stored_groups": len(store),
            "stored_bytes": store.nbytes, "leased_groups": store.count[LEASED],
            "excluded_groups": store.count[EXCLUDED], "active_leases": len(self.leases),
            "prompts_completed": self.ledger.num_completed, "prompts_leased": self.ledger.num_leased,
            "learner_version": self.learner_version,
            **{k: v for k, v in vars(c).items() if not isinstance(v, dict)},
            "dropped_stale_fraction": c.dropped_stale_total / c.inserted_total if c.inserted_total else 0.0,
            "work_budget_left": -1 if self.work_budget_left() is None else self.work_budget_left(),
            "inserted_by_newest_version": dict(c.inserted_by_newest_version),
            "staleness_at_sample": dict(c.staleness_at_sample),
            **self.limiter.info(),
        }

    # ---- persistence ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain values of everything but the groups (those go to Arrow files)."""
        c = self.counters
        counters = {k: v for k, v in vars(c).items() if not isinstance(v, dict)}
        counters["inserted_by_newest_version"] = [[k, v] for k, v in c.inserted_by_newest_version.items()]
        counters["staleness_at_sample"] = [[k, v] for k, v in c.staleness_at_sample.items()]
        return {"learner_version": self.learner_version, "next_key": self.next_key, "counters": counters,
                "timeline": self.timeline, "timeline_start": self.timeline_start, "retired": list(self.retired),
                "limiter": self.limiter.state_dict(), "ledger": self.ledger.state_dict(),
                "leases": [[x.lease_id, list(x.keys), x.consumer, x.expires_at, x.request_id]
                           for x in self.leases.values()],
                "acked_leases": list(self.acked_leases)}

    def load_state_dict(self, state: dict, groups: list[Group]) -> None:
        """Replace everything with ``state`` and ``groups`` (from ``state_dict`` and a snapshot)."""
        self.store = GroupStore(self.config, self._rng)
        self.store.add_many(groups)
        self.learner_version, self.next_key = int(state["learner_version"]), int(state["next_key"])
        self.timeline, self.timeline_start = int(state.get("timeline", SHARED)), int(state.get("timeline_start", -1))
        self.retired = [int(t) for t in state.get("retired", [])]  # snapshots before timelines: none
        raw = dict(state["counters"])
        by_version = {int(k): int(v) for k, v in raw.pop("inserted_by_newest_version")}
        lags = {int(k): int(v) for k, v in raw.pop("staleness_at_sample")}
        self.counters = Counters(**raw, inserted_by_newest_version=by_version, staleness_at_sample=lags)
        self.ledger.load_state_dict(state["ledger"])
        # [id, keys, consumer, expires_at, request_id]; snapshots before idempotent Sample have no request_id
        self.leases = {x[0]: Lease(x[0], tuple(x[1]), x[2], float(x[3]), x[4] if len(x) > 4 else "")
                       for x in state["leases"]}
        self.acked_leases = dict.fromkeys(state.get("acked_leases", []))  # older snapshots: none remembered
        self.limiter.load_state_dict(state["limiter"])
