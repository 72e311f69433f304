"""A sharded replay seen as one: ``ShardedReplayClient`` has ``ReplayClient``'s calls over K replay shards.

``replay.shards: K`` runs K replay processes; prompt ``i`` belongs to shard ``i mod K`` (``ReplayConfig.shards``),
which holds its leases, its group, its WAL records and its completion. The run's replay address is then the
shards' addresses in shard order, comma-separated (``join_addresses``); ``connect_replay`` answers a plain
``ReplayClient`` for one address, so a one-shard run is exactly the unsharded one.

How each call spans the shards:

* ``insert``: each group goes to its prompt's shard (a rollout's insert is one group: one call).
* ``lease_prompts``: asks the shards in turn, starting at a different one each call, until ``count`` prompts
  are leased or every shard said no (its share of the work budget spent, or its share of ``max_ready`` groups ready
  there); a shard that is down is passed over, and its share of ``max_ready`` goes to the others until it answers.
* ``sample``: whole groups from several shards. The shards' ``Info`` says how many groups each has ready; the
  batch is split between them in proportion to what each holds (a shard that is down counts as holding none, so
  batches go on coming from the others; when they hold too few the call raises at once, for the caller to retry
  through the address the supervisor pushes after the restart), each part is leased with its own ``Sample``
  (concurrently),
  and the batch's lease id names every part (``"k:lease,k:lease"``, ``ack``/``release`` split it again). If a
  part comes back short (its shard dropped stale groups at the new version, or its rate limiter said no), the
  other parts are released and the split is tried again, until ``timeout_s``. Lockstep (``prompt_indices``):
  each shard leases its own prompts, and the batch keeps the order asked for.
* ``rejoin``, ``snapshot``, ``info``: every shard; ``info`` sums the shards' counters (``learner_version``: the
  newest).

A shard that does not answer makes the calls that need it (an insert of its groups, an ack of its part, a lockstep
batch with its prompts) raise ``ReplayUnavailableError`` as an unsharded replay would, after the other parts of the
call were done or released; the caller retries, as it does for one replay. Leasing prompts and sampling pass it
over while another shard answers. A part whose answer was lost
stays leased until replay's ``lease_ttl_s``: its groups are neither lost nor trained twice.
"""

from __future__ import annotations

import itertools
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from gyre.proto import replay_pb2

SEPARATOR = ","
"""Between the shards' addresses in a sharded replay's address."""
LEASE_PART = ","
"""Between the parts of a sharded lease id; each part is ``{shard}:{lease_id}``."""
SAMPLE_POLL_S = 0.05
"""Seconds between looks at the shards' ready groups while a ``sample`` waits for enough of them."""
PART_TIMEOUT_S = 2.0
"""Longest one part of a split ``sample`` waits on its shard (the split came from ``Info``, so it is there)."""


def join_addresses(addresses: list[str]) -> str:
    """The run's replay address for shards at ``addresses`` (shard order).

    Raises:
        ValueError: no address, or one that is empty or holds the separator.
    """
    if not addresses or any(not a or SEPARATOR in a for a in addresses):
        raise ValueError(f"replay shard addresses {addresses!r}: expected one non-empty host:port per shard")
    return SEPARATOR.join(addresses)


def split_addresses(address: str) -> list[str]:
    """The shards' addresses in a replay address (one for an unsharded replay).

    Raises:
        ValueError: an empty address or an empty shard address in it.
    """
    parts = address.split(SEPARATOR) if isinstance(address, str) else []
    if not parts or any(not p.strip() for p in parts):
        raise ValueError(f"replay address {address!r}: expected host:port, or one host:port per shard "
                         f"separated by {SEPARATOR!r}")
    return [p.strip() for p in parts]


def connect_replay(address: str, security=None, timeout_s: float = 30.0):
    """A ``ReplayClient`` for one replay, a ``ShardedReplayClient`` for a sharded one (``split_addresses``)."""
    from gyre.services.common.replay_client import ReplayClient

    parts = split_addresses(address)
    if len(parts) == 1:
        return ReplayClient(parts[0], timeout_s=timeout_s, security=security)
    return ShardedReplayClient([ReplayClient(p, timeout_s=timeout_s, security=security) for p in parts])


def shard_of(prompt_index: int, shards: int) -> int:
    """The shard holding prompt ``prompt_index`` (``ReplayConfig.shards``)."""
    return prompt_index % shards


def split_lease_id(lease_id: str) -> list[tuple[int, str]]:
    """``[(shard, shard's lease id)]`` of a sharded lease id.

    Raises:
        ValueError: a part that is not ``{shard}:{lease_id}``.
    """
    out = []
    for part in lease_id.split(LEASE_PART):
        shard, sep, inner = part.partition(":")
        if not sep or not shard.isdigit() or not inner:
            raise ValueError(f"lease id {lease_id!r}: expected parts '<shard>:<lease id>' joined by {LEASE_PART!r}")
        out.append((int(shard), inner))
    return out


def merge_info(infos: list[replay_pb2.InfoResponse]) -> replay_pb2.InfoResponse:
    """One ``InfoResponse`` for the shards': counters, sizes and rates summed (maps per key), ``learner_version``
    the newest, ages and latency quantiles the largest, ``schema_version`` the first shard's."""
    out = replay_pb2.InfoResponse()
    for field in replay_pb2.InfoResponse.DESCRIPTOR.fields:
        name = field.name
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            target = getattr(out, name)
            for info in infos:
                for k, v in getattr(info, name).items():
                    target[k] = target[k] + v
        elif name == "schema_version":
            setattr(out, name, getattr(infos[0], name))
        elif name == "learner_version" or name.endswith("_age_s") or "_latency_" in name:
            setattr(out, name, max(getattr(i, name) for i in infos))
        elif field.type in (field.TYPE_DOUBLE, field.TYPE_FLOAT, field.TYPE_INT64, field.TYPE_UINT64,
                            field.TYPE_INT32, field.TYPE_UINT32):
            setattr(out, name, sum(getattr(i, name) for i in infos))
    return out


def merge_info_dicts(infos: list[dict]) -> dict:
    """``ReplayActor.info()`` of every shard as one dict (``merge_info``'s rules): numbers summed, maps summed key by
    key, ``learner_version`` the newest, ages (``*_age_s``) and latency quantiles (``*_latency_*``) the largest,
    anything else the first shard's."""
    out = dict(infos[0])
    for key, first in infos[0].items():
        values = [i.get(key) for i in infos]
        if key == "learner_version" or key.endswith("_age_s") or "_latency_" in key:
            present = [v for v in values if v is not None]
            out[key] = max(present) if present else None
        elif isinstance(first, dict):
            merged: dict = {}
            for v in values:
                for k, n in (v or {}).items():
                    merged[k] = merged.get(k, 0) + n
            out[key] = merged
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            out[key] = sum(v for v in values if isinstance(v, (int, float)))
    out["shards"] = len(infos)
    return out


class ShardedReplayClient:
    """``ReplayClient``'s calls over the shards of one replay (see the module docstring for each call).

    Args:
        shards: one client per shard, in shard order (``ReplayClient``s, or test doubles with its methods).

    Raises:
        ValueError: fewer than two shards.
    """

    def __init__(self, shards: list) -> None:
        if len(shards) < 2:
            raise ValueError(f"a sharded replay needs >= 2 shards, got {len(shards)}")
        self.shards = list(shards)
        self._pool = ThreadPoolExecutor(max_workers=len(shards), thread_name_prefix="replay-shard")
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._down: set[int] = set()
        """Shards whose last ``lease_prompts`` failed: their share of ``max_ready`` goes to the others meanwhile."""

    @property
    def address(self) -> str:
        return join_addresses([s.address for s in self.shards])

    @property
    def timeout_s(self) -> float:
        return self.shards[0].timeout_s

    def _all(self, call, shards: list[int] | None = None) -> list:
        """``call(k)`` for each shard ``k`` of ``shards`` (default: all) concurrently; results in order. Every call
        ends before the first error is raised."""
        futures = [self._pool.submit(call, k) for k in (range(len(self.shards)) if shards is None else shards)]
        errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return [f.result() for f in futures]

    # ---- rollouts ---------------------------------------------------------------------------------
    def insert(self, table: pa.Table) -> replay_pb2.InsertResponse:
        """Each group to its prompt's shard; the answers' row counts summed. Safe to retry (ids dedupe per shard)."""
        shard = np.asarray(table.column("prompt_index").to_numpy(zero_copy_only=False)) % len(self.shards)
        present = np.unique(shard).tolist()
        parts = {k: (table if len(present) == 1 else table.filter(pa.array(shard == k))) for k in present}
        answers = self._all(lambda k: self.shards[k].insert(parts[k]), present)
        return replay_pb2.InsertResponse(accepted=sum(a.accepted for a in answers),
                                         duplicates=sum(a.duplicates for a in answers),
                                         dropped_stale=sum(a.dropped_stale for a in answers))

    def lease_prompts(self, consumer: str, count: int, ttl_s: float = 0.0, below: int = 0,
                      max_ready: int = 0, policy_version: int | None = None) -> list[tuple[int, int]]:
        """Up to ``count`` prompts from the shards in turn (a different first shard each call, spread by
        ``consumer``); ``max_ready`` applies per shard as its share (rounded up)."""
        k = len(self.shards)
        with self._lock:
            start = (next(self._turn) + zlib.crc32(consumer.encode())) % k
            live = max(k - len(self._down), 1)
        per_shard_ready = -(-max_ready // live) if max_ready > 0 else 0  # a down shard's share goes to the others
        got: list[tuple[int, int]] = []
        down: list[ConnectionError] = []
        for step in range(k):
            if len(got) >= count:
                break
            shard = (start + step) % k
            try:
                got += self.shards[shard].lease_prompts(consumer, count - len(got), ttl_s, below, per_shard_ready,
                                                        policy_version)
                self._down.discard(shard)
            except ConnectionError as exc:  # that shard is down or restarting: lease from the others
                down.append(exc)
                self._down.add(shard)
        if len(down) == k:
            raise down[0]
        return got

    # ---- the learner ------------------------------------------------------------------------------
    def sample(self, num_groups: int, learner_version: int, timeout_s: float, consumer: str = "",
               prompt_indices: list[int] | None = None, request_id: str = "") -> tuple[str, pa.Table] | None:
        """Lease ``num_groups`` whole groups across the shards within ``timeout_s``; ``None`` if they are not there.
        Returns ``(sharded lease id, table)``; raises ``ReplayUnavailableError`` when a shard does not answer."""
        if prompt_indices:
            return self._sample_lockstep(num_groups, learner_version, timeout_s, consumer, prompt_indices, request_id)
        deadline = time.monotonic() + timeout_s
        for attempt in itertools.count():
            split, down = self._split(num_groups)
            if not split and down is not None:  # not enough without a shard that is down: the caller retries (after
                raise down                      # a restart, through the new address the supervisor pushes it)
            if split:
                got = self._lease_parts(split, learner_version, consumer,
                                        min(PART_TIMEOUT_S, max(deadline - time.monotonic(), 0.1)),
                                        f"{request_id}/{attempt}" if request_id else "")
                if got is not None:
                    return got
            if time.monotonic() >= deadline:
                return None
            time.sleep(SAMPLE_POLL_S)
        return None  # pragma: no cover

    def _split(self, num_groups: int) -> tuple[dict[int, int], ConnectionError | None]:
        """``({shard: groups}, error)``: groups summing to ``num_groups`` from the shards' ready groups (most first),
        or ``{}`` when they do not hold that many; ``error``: the ``ConnectionError`` of a shard that did not answer
        (it counts as holding none, so the batch may come from the others), else ``None``."""
        def ready_of(k: int):
            try:
                return int(self.shards[k].info().size_groups)
            except ConnectionError as exc:
                return exc
        answers = self._all(ready_of)
        down = next((a for a in answers if isinstance(a, ConnectionError)), None)
        ready = [0 if isinstance(a, ConnectionError) else a for a in answers]
        total = sum(ready)
        if total < num_groups:
            return {}, down
        # in proportion to what each shard holds, so every shard's queue drains alike (taking the fullest first
        # left a shard's groups to age past the staleness gate); the rounding's remainder from the fullest
        split = {k: num_groups * r // total for k, r in enumerate(ready)}
        left = num_groups - sum(split.values())
        for k in sorted(range(len(ready)), key=lambda k: -ready[k]):
            extra = min(ready[k] - split[k], left)
            split[k], left = split[k] + extra, left - extra
        return {k: n for k, n in split.items() if n}, down

    def _lease_parts(self, split: dict[int, int], learner_version: int, consumer: str, timeout_s: float,
                     request_id: str, prompt_indices: dict[int, list[int]] | None = None):
        """Lease each shard's part; ``(sharded lease id, rows in shard order)``, or ``None`` after releasing the
        parts leased when one came back short."""
        shards = list(split)

        def part(k):
            return self.shards[k].sample(split[k], learner_version, timeout_s, consumer,
                                 prompt_indices=(prompt_indices or {}).get(k),
                                 request_id=f"{request_id}/{k}x{split[k]}" if request_id else "")
        futures = [self._pool.submit(part, k) for k in shards]
        results = [(k, f.exception(), None if f.exception() else f.result()) for k, f in zip(shards, futures)]
        if any(err is not None or got is None for _, err, got in results):
            held = [(k, got[0]) for k, err, got in results if err is None and got is not None]
            for k, lease in held:
                try:
                    self.shards[k].release([lease])
                except Exception:  # noqa: BLE001 - it expires at lease_ttl_s; nothing is lost
                    pass
            error = next((err for _, err, _ in results if err is not None), None)
            if error is not None:
                raise error
            return None
        lease_id = LEASE_PART.join(f"{k}:{got[0]}" for k, _, got in results)
        return lease_id, pa.concat_tables([got[1] for _, _, got in results])

    def _sample_lockstep(self, num_groups, learner_version, timeout_s, consumer, prompt_indices, request_id):
        per_shard: dict[int, list[int]] = {}
        for p in prompt_indices:
            per_shard.setdefault(shard_of(p, len(self.shards)), []).append(p)
        got = self._lease_parts({k: len(v) for k, v in per_shard.items()}, learner_version, consumer, timeout_s,
                                request_id, per_shard)
        if got is None:
            return None
        lease_id, table = got
        rank = {p: i for i, p in enumerate(prompt_indices)}
        order = np.argsort(np.array([rank[p] for p in table.column("prompt_index").to_pylist()]), kind="stable")
        return lease_id, table.take(pa.array(order))

    def _per_shard(self, lease_ids: list[str]) -> dict[int, list[str]]:
        parts: dict[int, list[str]] = {}
        for lease_id in lease_ids:
            for k, inner in split_lease_id(lease_id):
                if k >= len(self.shards):
                    raise ValueError(f"lease id {lease_id!r} names shard {k}; this replay has {len(self.shards)}")
                parts.setdefault(k, []).append(inner)
        return parts

    def ack(self, lease_ids: list[str]) -> int:
        """Ack each part on its shard (idempotent there); the groups acked, summed."""
        parts = self._per_shard(lease_ids)
        return sum(self._all(lambda k: self.shards[k].ack(parts[k]), list(parts)))

    def release(self, lease_ids: list[str]) -> int:
        parts = self._per_shard(lease_ids)
        return sum(self._all(lambda k: self.shards[k].release(parts[k]), list(parts)))

    def rejoin(self, consumer: str, learner_version: int, timeline: int = 0) -> int:
        """``Rejoin`` on every shard; the leases released, summed."""
        return sum(self._all(lambda k: self.shards[k].rejoin(consumer, learner_version, timeline)))

    def update_priorities(self, group_ids: list[str], priorities: list[float]) -> tuple[int, list[str]]:
        """Each group's priority on its prompt's shard (``group_id`` is ``"{prompt_index}-{attempt}"``)."""
        if len(group_ids) != len(priorities):
            raise ValueError(f"{len(group_ids)} group ids and {len(priorities)} priorities; expected as many of each")
        parts: dict[int, tuple[list[str], list[float]]] = {}
        for gid, pr in zip(group_ids, priorities):
            head = gid.split("-", 1)[0]
            if not head.isdigit():
                raise ValueError(f"group id {gid!r}: expected '<prompt_index>-<attempt>'")
            ids, prs = parts.setdefault(shard_of(int(head), len(self.shards)), ([], []))
            ids.append(gid)
            prs.append(pr)
        answers = self._all(lambda k: self.shards[k].update_priorities(*parts[k]), list(parts))
        return sum(a[0] for a in answers), [g for a in answers for g in a[1]]

    def snapshot(self) -> str:
        """A snapshot on every shard; their directories, comma-separated (a shard with nothing new adds none)."""
        return SEPARATOR.join(p for p in self._all(lambda k: self.shards[k].snapshot()) if p)

    def info(self) -> replay_pb2.InfoResponse:
        return merge_info(self._all(lambda k: self.shards[k].info()))

    def close(self) -> None:
        for c in self.shards:
            c.close()
        self._pool.shutdown(wait=False)
