"""The trajectory buffer: thread-safe replay core (waiting, rate limiting, WAL) over ``ReplayState``.

Used in-process by tests and behind ``services.replay.server`` in production. With ``config.dir`` set
the buffer restores itself from that directory at construction and logs every change to its WAL.

Every mutating call follows one protocol: decide under the lock what changes (picks, evictions,
expiries) → append the record to the WAL → apply it with ``ReplayState.apply`` (both still under the
lock, so log order is apply order) → release the lock → wait until the record is durable → return.
A caller therefore never sees an answer describing state a crash could take back; expensive work
(validation, splitting groups, encoding an insert) happens before the lock.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import uuid
from collections import Counter

import pyarrow as pa

from gyre.proto.trajectory import SchemaError, to_ipc
from gyre.replay.config import ReplayConfig
from gyre.replay.durable import Durability
from gyre.replay.groups import split_batch, split_groups
from gyre.replay.prompt_leases import PromptLeases
from gyre.replay.rate_limiter import RateLimitedError
from gyre.replay.records import Record, encode_parts
from gyre.replay.snapshot import SnapshotData
from gyre.replay.state import ReplayState
from gyre.replay.stats import LatencyWindow, RateWindow
from gyre.replay.types import InsertResult, UnknownLeaseError, checked_sample_args

__all__ = ["TrajectoryBuffer", "InsertResult", "UnknownLeaseError", "RateLimitedError"]

class TrajectoryBuffer:
    """Stores GRPO groups as Arrow tables and leases them out whole.

    Args:
        config: selection, staleness, limits and (``dir``) durability settings.
        clock: seconds for lease deadlines; wall clock by default because deadlines are persisted.

    Raises:
        RestoreError: ``config.dir`` holds data but no valid snapshot/WAL combination loads.
    """

    def __init__(self, config: ReplayConfig, clock=time.time) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Condition()
        self._prepare_lock = threading.Lock()
        """Serialises the validate/split/encode step of concurrent inserts: it is many short pyarrow
        calls, each releasing and retaking the GIL; two threads doing it at once hand the GIL back and
        forth at every call (a context switch each) and together run ~2x slower than one after the other."""
        self.state = ReplayState(config, clock, random.Random(config.seed))
        self._wal = None
        self._waiting: Counter[int] = Counter()
        self._inserts, self._samples = RateWindow(), RateWindow()
        self.latency = {"insert": LatencyWindow(), "lease_prompts": LatencyWindow()}
        """Latencies of the server's requests, seconds (``services.replay.server`` records them): an insert from its
        receipt to its durable answer, a prompt lease from call to answer; ``info()`` gives their p50 and p99."""
        self.prompts = PromptLeases(self.state, self._lock, self._commit, self.wait_durable, clock,
                                    config.prompt_lease_ttl_s)
        """Prompt indices for rollouts (``replay.prompt_leases``), logged through this buffer."""
        self.durability = None
        self._foreground = None
        """The durability's ``ForegroundGate``: an insert's store step is foreground work that a
        snapshot's background steps wait for (``replay.files``)."""
        if config.dir is not None:  # restore first, then log every change from here on
            self.durability = Durability(self)
            self._wal = self.durability.wal
            self._foreground = self.durability.foreground
            self.durability.start()

    @property
    def ledger(self):
        return self.state.ledger

    @property
    def counters(self):
        return self.state.counters

    # ---- protocol -------------------------------------------------------------------------------
    def _commit(self, rec: Record, encoded: list | None = None, plan=None):
        """Log then apply one record (caller holds the lock; ``encoded``: its ``encode_parts``, else
        encoded here); returns ``(lsn, apply result)``."""
        lsn = -1
        if self._wal is not None:
            lsn = self._wal.append([encoded if encoded is not None else encode_parts(rec)])
        return lsn, self.state.apply(rec, plan)

    def _wait(self, ready, deadline: float) -> bool:
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._lock.wait(timeout=min(remaining, 1.0))
        return True

    # ---- insert ---------------------------------------------------------------------------------
    def insert(self, table: pa.Table, payload: bytes | None = None, timeout_s: float | None = None) -> InsertResult:
        """Store the whole groups in ``table``; returns once durable (rows already seen count as duplicates).

        Args:
            table: trajectories, ``TRAJECTORY_SCHEMA``.
            payload: the Arrow IPC bytes ``table`` was read from, logged as is (else re-encoded).
            timeout_s: longest wait for the rate limiter (default ``config.insert_timeout_s``).

        Raises:
            SchemaError: the table is invalid; nothing is stored.
            RateLimitedError: the rate limiter held the insert back for ``timeout_s``; nothing is stored.
            WalError: the log cannot persist it.
        """
        result, lsn = self.insert_nowait(table, payload, timeout_s)
        self.wait_durable(lsn)
        return result

    def insert_nowait(self, table: pa.Table, payload: bytes | None = None,
                      timeout_s: float | None = None) -> tuple[InsertResult, int]:
        """``insert`` without the durability wait: returns ``(result, lsn)``; the caller must
        ``wait_durable(lsn)`` before acknowledging (lets a stream store the next batch meanwhile)."""
        with self._urgent(), self._prepare_lock:
            if self._wal is not None and payload is None:
                payload = to_ipc(table)
            plan = split_groups(table, None if payload is None else len(payload))
            self._check_owned(plan)
            encoded = [self._encode_insert(payload)] if self._wal is not None else []
        deadline = time.monotonic() + (self.config.insert_timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            if not self._wait(lambda: self.state.can_insert(max(self._waiting, default=0)), deadline):
                raise RateLimitedError(self.state.limiter.why_not_insert())
            results, lsn = self._store(encoded, plan)
        return results[0], lsn

    def insert_batch(self, items: list[tuple[pa.Table, bytes]]) -> list[tuple[InsertResult, int]] | None:
        """Several inserts, in order, as one step: one split of their concatenated rows, one WAL
        ``writev`` of their records (one record per insert, as ``insert_nowait`` logs them), one
        apply. The stored groups, counters, ledger and WAL equal those of the inserts made one by one;
        only an eviction they cause runs once, after all of them. Returns ``[(result, lsn), ...]``
        per insert (``wait_durable(lsn)`` before acknowledging it), or ``None`` (nothing stored) where
        they must go one by one through ``insert_nowait``: a rate limiter is configured (it may
        hold back any one of them), or ``groups.split_batch`` cannot batch them (a bad insert among
        them, a group id in two of them, ...).

        Args:
            items: ``(table, payload)`` per insert, as for ``insert_nowait``; ``payload`` is required.

        Raises:
            WalError: the log cannot persist them (nothing is applied).
        """
        if self.config.rate_limiter.samples_per_insert is not None or len(items) < 2:
            return None
        with self._urgent(), self._prepare_lock:
            plan = split_batch([t for t, _ in items], [len(p) for _, p in items])
            if plan is None or not all(map(self.state.ledger.owns, plan.prompt_index)):
                return None  # one by one: ``insert_nowait`` names the misrouted prompt
            encoded = [self._encode_insert(p) for _, p in items] if self._wal is not None else []
        with self._lock:
            results, lsn = self._store(encoded, plan)
        return [(r, lsn) for r in results]

    def _check_owned(self, plan) -> None:
        """Raises ``SchemaError`` naming the first prompt of ``plan`` this shard does not own (a client that routes
        inserts by another shard count); nothing is stored."""
        ledger = self.state.ledger
        wrong = next((p for p in plan.prompt_index if not ledger.owns(p)), None)
        if wrong is not None:
            raise SchemaError(f"prompt_index {wrong} belongs to replay shard {wrong % ledger.shards} of {ledger.shards}, "
                              f"not to this shard ({ledger.shard}); route each group to shard prompt_index mod shards")

    def _encode_insert(self, payload) -> list:
        """The WAL record of one insert (``records.encode_parts`` pieces)."""
        return encode_parts(Record("insert", {}, payload), self.config.wal.compression, self.config.wal.zstd_level)

    def _store(self, encoded: list, plan) -> tuple[list, int]:
        """Log the inserts' records (``encoded``, one per insert ``plan`` covers; none in memory), apply
        ``plan``, evict down to capacity (caller holds the lock); returns ``(results, lsn)``."""
        with self._urgent():  # not the rate limiter's wait before it: that is no work
            before, lsn = self.state.next_key, -1
            if self._wal is not None:
                lsn = self._wal.append(encoded)
            results = self.state.insert_parts(plan)
            evict = self.state.eviction_keys(self.state.next_key - before)
            if evict:
                lsn, _ = self._commit(Record("evict", {"keys": evict}))
        self._inserts.add(sum(r.accepted for r in results))
        self._lock.notify_all()
        return results, lsn

    def foreground(self):
        """Context manager marking foreground work (an RPC's store or ack wait): a snapshot's next
        background step waits for it (``replay.files.ForegroundGate``); a no-op in memory."""
        return self._urgent()

    def _urgent(self):
        """Mark foreground work: a snapshot's next background step waits for it (``ForegroundGate``)."""
        return self._foreground.urgent() if self._foreground is not None else contextlib.nullcontext()

    def wait_durable(self, lsn: int) -> None:
        """Block until WAL record ``lsn`` is durable (no-op in memory). Raises ``WalError``."""
        if self._wal is not None and lsn >= 0:
            self._wal.wait(lsn)

    # ---- sample / leases ------------------------------------------------------------------------
    def sample(self, num_groups: int, learner_version: int, timeout_s: float = 0.0, consumer: str = "",
               prompt_indices: list[int] | None = None, request_id: str = "") -> tuple[str, pa.Table] | None:
        """Lease ``num_groups`` whole groups chosen by the selector; wait up to ``timeout_s`` seconds.

        Raising ``learner_version`` drops (or excludes) groups whose lag exceeds ``max_staleness``.
        With ``prompt_indices`` (lockstep, ``proto.lockstep``) the lease is exactly the pooled groups of those
        prompts in that order, once every one of them is pooled; the selector is not consulted.
        Returns ``(lease_id, table)`` with the groups' rows in hand-out order, or ``None`` on timeout.

        ``request_id`` (idempotency key, the same on every retry of one logical sample): when ``consumer``
        still holds the lease an earlier attempt made (logged, but its answer lost in a crash), that
        lease and its rows are returned again and nothing changes; otherwise a new lease remembers the key.

        Raises:
            ValueError: ``num_groups < 1``; ``prompt_indices`` not ``num_groups`` distinct indices >= 0;
                ``request_id`` longer than 128 characters, or naming a lease of another ``num_groups``.
        """
        prompt_indices = checked_sample_args(num_groups, prompt_indices, request_id)
        deadline = time.monotonic() + max(timeout_s, 0.0)
        if request_id:
            with self._lock:
                held, logged = self._held_lease(consumer, request_id, num_groups)
            if held is not None:
                self.wait_durable(logged)  # the first attempt's lease record may still await its fsync
                return held
        with self._lock:
            lsn = -1
            if learner_version > self.state.learner_version:
                lsn, _ = self._commit(Record("learner_version", {"version": learner_version}))
            self._waiting[num_groups] += 1
            self._lock.notify_all()  # an inserter may be waiting only because nobody sampled

            def ready() -> bool:
                nonlocal lsn
                lsn = max(lsn, self._expire_leases())
                if prompt_indices is not None:
                    return self.state.store.pooled_for_prompts(prompt_indices) is not None
                return self.state.can_sample(num_groups)

            try:
                got = self._wait(ready, deadline)
            finally:
                self._waiting[num_groups] -= 1
                self._waiting += Counter()  # drop zero counts
            if got:
                keys = (self.state.store.sampler.pick(num_groups) if prompt_indices is None
                        else self.state.store.pooled_for_prompts(prompt_indices))
                lease_id = uuid.uuid4().hex
                meta = {"lease_id": lease_id, "keys": keys, "consumer": consumer,
                        "expires_at": self._clock() + self.config.lease_ttl_s}
                if request_id:
                    meta["request_id"] = request_id
                lsn, groups = self._commit(Record("lease", meta))
                table = pa.concat_tables([g.table for g in groups])
                self._samples.add(len(groups))
                self._lock.notify_all()
        self.wait_durable(lsn)
        return (lease_id, table) if got else None

    def _held_lease(self, consumer: str, request_id: str, num_groups: int) -> tuple[tuple | None, int]:
        """``((lease_id, table), lsn)`` of the lease a retried ``Sample`` (same ``request_id``) already
        made, where ``lsn`` is a log position at or after its record (wait for it before answering), or
        ``(None, -1)``: no such lease, or it is past its deadline (the normal path expires it and leases
        afresh, never handing out a lease whose groups may already be back in the pool); the caller holds
        the lock."""
        lease = self.state.lease_of_request(consumer, request_id)
        if lease is None or lease.expires_at <= self._clock():
            return None, -1
        if len(lease.keys) != num_groups:
            raise ValueError(f"request_id {request_id!r} names lease {lease.lease_id} of {len(lease.keys)} groups; "
                             f"this retry asks for num_groups {num_groups}")
        logged = self._wal.next_lsn - 1 if self._wal is not None else -1
        return (lease.lease_id, pa.concat_tables([self.state.store.groups[k].table for k in lease.keys])), logged

    def _expire_leases(self) -> int:
        now = self._clock()
        due = [i for i, lease in self.state.leases.items() if lease.expires_at <= now]
        return self._commit(Record("expire", {"lease_ids": due}))[0] if due else -1

    def _end(self, kind: str, lease_ids: list[str]) -> int:
        with self._lock:
            self.state.check_leases(lease_ids, acked_ok=kind == "ack")
            lease_ids = [i for i in dict.fromkeys(lease_ids) if i in self.state.leases]  # acked before: done
            if not lease_ids:
                return 0
            lsn, n = self._commit(Record(kind, {"lease_ids": lease_ids}))
            self._lock.notify_all()
        self.wait_durable(lsn)
        return n

    def ack(self, lease_ids: list[str]) -> int:
        """Mark leased groups consumed (deleted, or pooled again below ``max_times_sampled``); returns
        how many groups. A lease acked before (one of the last ``ACKED_MEMORY``) counts 0: an ack retried
        after a restart is idempotent. Raises ``UnknownLeaseError`` naming the first unknown id; nothing
        changes."""
        return self._end("ack", lease_ids)

    def release(self, lease_ids: list[str]) -> int:
        """Return leased groups to the pool untouched; returns how many. Raises ``UnknownLeaseError``."""
        return self._end("release", lease_ids)

    def rejoin(self, consumer: str, learner_version: int, timeline: int = 0) -> int:
        """``consumer`` restarted from a checkpoint at policy version ``learner_version``: release every
        lease it still holds and set the learner version to ``learner_version`` even if that is lower
        (the ``Sample`` path only ever raises it). Call after re-acking the checkpoint's own leases.
        ``timeline`` (``proto.timeline``; 0: none) names the learner incarnation: a new one retires the
        previous learner's timeline, whose versions above ``learner_version`` are then dead: stored groups
        of them are deleted and later inserts of them dropped (``dead_timeline_total``).
        Returns how many groups were released.

        Raises:
            ValueError: ``consumer`` is empty or ``learner_version < 0``.
        """
        if not consumer:
            raise ValueError("consumer must be a non-empty name (the one passed to sample)")
        if learner_version < 0:
            raise ValueError(f"learner_version ({learner_version}) must be >= 0")
        with self._lock:
            meta = {"consumer": consumer, "version": int(learner_version)}
            if timeline:
                meta["timeline"] = int(timeline)
            lsn, n = self._commit(Record("rejoin", meta))
            self._lock.notify_all()
        self.wait_durable(lsn)
        return n

    def update_priorities(self, group_ids: list[str], priorities: list[float]) -> tuple[int, list[str]]:
        """Set sampling priorities; returns ``(updated, unknown group ids)`` (consumed groups are unknown).

        Raises:
            ValueError: lengths differ, or a priority is negative or not finite (nothing changes).
        """
        if len(group_ids) != len(priorities):
            raise ValueError(f"{len(group_ids)} group_ids but {len(priorities)} priorities")
        for gid, p in zip(group_ids, priorities):
            if not (p >= 0 and p != float("inf")):
                raise ValueError(f"priority {p} for group {gid!r} must be finite and >= 0")
        with self._lock:
            key_of = self.state.store.key_of
            known = [(key_of[g], float(p)) for g, p in zip(group_ids, priorities) if g in key_of]
            unknown = [g for g in group_ids if g not in key_of]
            lsn = -1
            if known:
                lsn, _ = self._commit(Record("priority", {"keys": [k for k, _ in known],
                                                          "priorities": [p for _, p in known]}))
        self.wait_durable(lsn)
        return len(known), unknown

    # ---- prompts --------------------------------------------------------------------------------
    def lease_prompts(self, consumer: str, count: int, ttl_s: float | None = None,
                      below: int | None = None, max_ready: int | None = None,
                      policy_version: int | None = None) -> list[tuple[int, int]]:
        """``PromptLeases.lease`` (``replay.prompt_leases``): the rollout's ``ReplaySink`` call, in process."""
        return self.prompts.lease(consumer, count, ttl_s, below, max_ready, policy_version)

    # ---- persistence / info ---------------------------------------------------------------------
    def capture(self) -> SnapshotData:
        """A consistent copy-on-write view for a snapshot: O(groups) pointer copies under the lock."""
        with self._lock:
            lsn = self._wal.next_lsn if self._wal is not None else 0
            return SnapshotData(lsn, list(self.state.store.groups.values()), self.state.state_dict())

    def snapshot(self):
        """Write a snapshot now; returns its path. Raises ``RuntimeError`` without ``config.dir``."""
        if self.durability is None:
            raise RuntimeError("replay runs without a directory (config.dir is None); nothing to snapshot")
        return self.durability.snapshot()

    def close(self) -> None:
        """Stop background snapshots and close the WAL (durable buffers); idempotent."""
        if self.durability is not None:
            self.durability.close()

    def info(self) -> dict:
        """Plain counters for the Info RPC and metrics (see ``InfoResponse`` for each field)."""
        with self._lock:
            out = self.state.info()
            out.update(inserts_per_s=self._inserts.per_s(), samples_per_s=self._samples.per_s())
        for kind, window in self.latency.items():
            out.update({f"{kind}_latency_p50_s": window.quantile(0.5), f"{kind}_latency_p99_s": window.quantile(0.99)})
        if self.durability is not None:
            out.update(self.durability.info())
        return out
