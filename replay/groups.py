"""Stored GRPO groups and the indexes over them: the sampling pool, eviction order, staleness index.

A group is in exactly one of three states: ``pooled`` (can be sampled), ``leased`` (handed to a
consumer, waiting for ack/release/expiry) or ``excluded`` (too stale to hand out, kept because
``staleness_mode="exclude"``). Group records are frozen and replaced on change, so a snapshot can take
a consistent copy of the whole store with one ``dict.copy()`` under the buffer's lock.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gyre.proto.trajectory import TRAJECTORY_SCHEMA, SchemaError, validate_table
from gyre.replay.config import ReplayConfig
from gyre.replay.selectors import make_selector
from gyre.replay.types import EXCLUDED, LEASED, POOLED, Group, InsertPlan

def _check_ids(table: pa.Table, ints: dict[str, np.ndarray]) -> None:
    """Every ``trajectory_id`` is ``"{prompt_index}-{sample_index}-{attempt}"`` (one int → string cast
    of the three columns stacked); ``ints`` holds those columns as numpy arrays. Uniqueness is checked
    in ``_check_unique`` once groups are known."""
    n = table.num_rows
    if n == 0:
        return
    for name in ("prompt_index", "sample_index", "attempt"):
        col = ints[name]
        if col.min() < 0:
            i = int(np.flatnonzero(col < 0)[0])
            raise SchemaError(f"row {i}: {name} {int(col[i])} must be >= 0")
    stacked = np.concatenate([ints[c].astype(np.int64) for c in ("prompt_index", "sample_index", "attempt")])
    text = pc.cast(pa.array(stacked), pa.utf8())
    expected = pc.binary_join_element_wise(text.slice(0, n), text.slice(n, n), text.slice(2 * n, n), "-")
    ok = pc.equal(table.column("trajectory_id"), expected)
    if not pc.all(ok).as_py():
        i = pc.index(ok, False).as_py()
        raise SchemaError(f"row {i}: trajectory_id {table.column('trajectory_id')[i].as_py()!r} is not "
                          f"'{{prompt_index}}-{{sample_index}}-{{attempt}}' ({expected[i].as_py()!r})")


def _check_unique(table: pa.Table, codes: np.ndarray, samples: np.ndarray) -> None:
    """No trajectory id twice. Ids are ``"{prompt}-{sample}-{attempt}"`` (checked) and a group has
    one prompt and attempt (checked), so an id repeats exactly when a (group, sample_index) pair does."""
    key = (codes.astype(np.int64) << 32) | (samples.astype(np.int64) & 0xFFFFFFFF)
    ranked = np.argsort(key, kind="stable")
    same = key[ranked[1:]] == key[ranked[:-1]]
    if same.any():
        row = int(ranked[1:][same][0])
        raise SchemaError(f"trajectory_id {table.column('trajectory_id')[row].as_py()!r} appears more than "
                          "once in one insert")


def _span_ends(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the version of the first and of the last span (spans are non-empty, validated)."""
    col = table.column("version_span_versions").combine_chunks()
    offsets, values = col.offsets.to_numpy(), col.values.to_numpy()
    return values[offsets[:-1]], values[offsets[1:] - 1]


def group_timeline(rows: pa.Table) -> tuple[int, int]:
    """``(policy_timeline, newest version)`` of a group's rows: the largest of each over its rows."""
    _, last = _span_ends(rows)
    return int(pc.max(rows.column("policy_timeline")).as_py()), int(last.max())


def _group_rows(table: pa.Table) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Groups in first-appearance order: ``(group ids, row order, group starts in it, group sizes,
    per-row group index)``; the rows of group ``i`` are ``order[starts[i]: starts[i] + sizes[i]]``,
    ascending (one stable sort)."""
    encoded = pc.dictionary_encode(table.column("group_id")).combine_chunks()
    codes = encoded.indices.to_numpy()
    sizes = np.bincount(codes)
    order = np.argsort(codes, kind="stable")
    starts = np.zeros(len(sizes), np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    return encoded.dictionary.to_pylist(), order, starts, sizes, codes


def split_groups(table: pa.Table, nbytes: int | None = None) -> InsertPlan:
    """Validate an insert and split it into groups; nothing is stored.

    Vectorised over rows and groups (one dictionary encode and stable sort of ``group_id``, numpy
    ``reduceat`` over the sorted runs), since it runs for every insert. No per-group table is made: a
    group is ``(offset, rows)`` into ``plan.table``, which is the insert itself when every group's rows
    are contiguous (the usual case) and else one reordered copy (``take``) in which they are.

    Args:
        table: the insert, ``TRAJECTORY_SCHEMA``.
        nbytes: bytes to apportion to the groups by row count: the Arrow IPC payload's size when the
            table was read from one (live and WAL replay alike), else ``table.nbytes``.

    Raises:
        SchemaError: schema problems (see ``validate_table``), a trajectory id that is not
            ``"{prompt_index}-{sample_index}-{attempt}"``, a repeated id, or a group mixing prompts.
    """
    per_row = np.array([(table.nbytes if nbytes is None else nbytes) / max(table.num_rows, 1)])
    plan, _ = _split(table, per_row, None)
    return plan


def split_batch(tables: list[pa.Table], nbytes: list[int]) -> InsertPlan | None:
    """``split_groups`` for several inserts at once, as if they came one after another: the same
    groups in the same order with the same byte counts, each group pointing into its own insert's
    table (``plan.sources``), tagged with its insert's index (``plan.part``). One pass over the
    concatenated rows, so the per-call overhead of the checks is paid once per batch, not per insert.

    Args:
        tables: the inserts in arrival order, each read from an Arrow IPC payload.
        nbytes: each insert's payload size in bytes.

    Returns ``None`` where the batch cannot stand for the inserts one by one, and the caller must
    insert them singly (which also names the bad one): a schema other than ``TRAJECTORY_SCHEMA``
    (metadata included), a group id in two inserts (a retry's duplicates are counted per insert), a
    group whose rows are not contiguous, or any ``SchemaError``.
    """
    if len(tables) != len(nbytes) or not tables:
        raise ValueError(f"{len(tables)} tables and {len(nbytes)} sizes; expected as many of each, >= 1")
    if not all(t.schema.equals(TRAJECTORY_SCHEMA, check_metadata=True) for t in tables):
        return None
    rows = np.array([t.num_rows for t in tables], np.int64)
    per_row = np.array(nbytes, np.float64) / np.maximum(rows, 1)
    try:
        plan, contiguous = _split(pa.concat_tables(tables), per_row, np.repeat(np.arange(len(tables)), rows))
    except (SchemaError, _Straddles):
        return None
    if not contiguous:
        return None
    first_row = np.concatenate([[0], np.cumsum(rows)[:-1]])
    part = np.asarray(plan.part)
    return replace(plan, sources=[tables[i] for i in plan.part],
                   offset=(np.asarray(plan.offset) - first_row[part]).tolist())


class _Straddles(Exception):
    """A group id in more than one insert of a batch."""


def _split(table: pa.Table, per_row: np.ndarray, part_of_row: np.ndarray | None) -> tuple[InsertPlan, bool]:
    """The plan of ``split_groups`` / ``split_batch`` and whether every group's rows were contiguous.
    ``per_row``: bytes per row of each insert; ``part_of_row``: ``[rows]`` insert index, ``None`` for one."""
    validate_table(table)
    ints = {c: table.column(c).to_numpy() for c in ("prompt_index", "sample_index", "attempt")}
    _check_ids(table, ints)
    group_ids, order, starts, sizes, codes = _group_rows(table)
    part = np.zeros(len(starts), np.int64)
    if part_of_row is not None:
        in_part = part_of_row[order]
        if (np.minimum.reduceat(in_part, starts) != np.maximum.reduceat(in_part, starts)).any():
            raise _Straddles()
        part = in_part[starts]
    first, last = (x[order] for x in _span_ends(table))
    table_timelines = table.column("policy_timeline").to_numpy()
    prompts, attempts = ints["prompt_index"][order], ints["attempt"][order]
    uniform = ((np.minimum.reduceat(prompts, starts) == np.maximum.reduceat(prompts, starts))
               & (np.minimum.reduceat(attempts, starts) == np.maximum.reduceat(attempts, starts)))
    p_l, a_l = prompts[starts].tolist(), attempts[starts].tolist()
    bad = [i for i, (ok, g, p, a) in enumerate(zip(uniform.tolist(), group_ids, p_l, a_l)) if not ok or g != f"{p}-{a}"]
    if bad:
        rows = order[starts[bad[0]]: starts[bad[0]] + sizes[bad[0]]]
        seen = sorted(set(zip(table.column("prompt_index").to_numpy()[rows].tolist(),
                              table.column("attempt").to_numpy()[rows].tolist())))
        raise SchemaError(f"group {group_ids[bad[0]]!r} mixes prompt indices/attempts {seen}")
    _check_unique(table, codes, ints["sample_index"])
    contiguous = bool((order[starts + sizes - 1] - order[starts] + 1 == sizes).all())
    if contiguous:
        offsets = order[starts]  # every group is one run of the insert: keep the client's table
    else:
        table, offsets = table.take(order), starts
    one_newest = (np.minimum.reduceat(last, starts) == np.maximum.reduceat(last, starts)).tolist()
    n_l, new_l = sizes.tolist(), last[starts].tolist()
    newest = [((new_l[i], n_l[i]),) if one else
              tuple((int(v), int(c)) for v, c in zip(*np.unique(last[starts[i]: starts[i] + n_l[i]],
                                                                  return_counts=True)))
              for i, one in enumerate(one_newest)]
    plan = InsertPlan(table, group_ids, p_l, np.minimum.reduceat(first, starts).tolist(), offsets.tolist(), n_l,
                      (sizes * per_row[part]).astype(np.int64).tolist(), newest,
                      np.add.reduceat((first != last).astype(np.int64), starts).tolist(),
                      part=None if part_of_row is None else part.tolist(),
                      parts=1 if part_of_row is None else len(per_row),
                      timeline=np.maximum.reduceat(table_timelines[order], starts).tolist(),
                      newest=np.maximum.reduceat(last, starts).tolist())
    return plan, contiguous


class GroupStore:
    """All stored groups plus O(log n) indexes; not thread-safe (the buffer's lock guards it).

    Args:
        config: selector, eviction and priority settings.
        rng: random source of the uniform/prioritized selectors.
    """

    def __init__(self, config: ReplayConfig, rng: random.Random) -> None:
        self.groups: dict[int, Group] = {}
        self.key_of: dict[str, int] = {}
        """group_id → key of the stored group."""
        self.sampler = make_selector(config.selector, rng, config.priority_exponent)
        self.evictor = make_selector(config.eviction, rng)
        self.excluded: dict[int, None] = {}
        """Excluded keys, oldest first (evicted first)."""
        self._pool_by_version: dict[int, set[int]] = {}
        self.rows = {POOLED: 0, LEASED: 0, EXCLUDED: 0}
        self.count = {POOLED: 0, LEASED: 0, EXCLUDED: 0}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.groups)

    def _set(self, new: Group) -> None:
        old = self.groups.get(new.key)
        if old is not None:
            self.rows[old.state] -= old.num_rows
            self.count[old.state] -= 1
            if old.state == POOLED:
                self._unpool(old)
            elif old.state == EXCLUDED:
                del self.excluded[old.key]
        self.groups[new.key] = new
        self.rows[new.state] += new.num_rows
        self.count[new.state] += 1
        if new.state == POOLED:
            self.sampler.add(new.key, new.priority)
            self.evictor.add(new.key, new.priority)
            self._pool_by_version.setdefault(new.oldest_version, set()).add(new.key)
        elif new.state == EXCLUDED:
            self.excluded[new.key] = None

    def _unpool(self, g: Group) -> None:
        self.sampler.remove(g.key)
        self.evictor.remove(g.key)
        keys = self._pool_by_version[g.oldest_version]
        keys.discard(g.key)
        if not keys:
            del self._pool_by_version[g.oldest_version]

    def add(self, group: Group) -> None:
        """Store a new group (its ``state`` says pooled or excluded). Raises ``KeyError`` on a reused key."""
        if group.key in self.groups:
            raise KeyError(f"group key {group.key} is already stored")
        self.key_of[group.group_id] = group.key
        self.nbytes += group.nbytes
        self._set(group)

    def add_many(self, groups: list[Group]) -> None:
        """``add`` for one insert's new groups: one pass and one call per index instead of one per group.
        Raises ``KeyError`` on a reused key; then nothing is stored."""
        stored, keys = self.groups, [g.key for g in groups]
        if len(set(keys)) != len(keys) or any(k in stored for k in keys):
            dup = next(k for i, k in enumerate(keys) if k in stored or k in keys[:i])
            raise KeyError(f"group key {dup} is already stored")
        pooled = []
        for g in groups:
            stored[g.key] = g
            self.key_of[g.group_id] = g.key
            self.nbytes += g.nbytes
            self.rows[g.state] += g.num_rows
            self.count[g.state] += 1
            if g.state == POOLED:
                pooled.append(g)
            elif g.state == EXCLUDED:
                self.excluded[g.key] = None
        keys, priorities = [g.key for g in pooled], [g.priority for g in pooled]
        self.sampler.add_many(keys, priorities)
        self.evictor.add_many(keys, priorities)
        by_version = self._pool_by_version
        for g in pooled:
            by_version.setdefault(g.oldest_version, set()).add(g.key)

    def set_state(self, key: int, state: str, sampled_delta: int = 0) -> Group:
        """Move a stored group to ``state`` (and add ``sampled_delta`` to its sample count)."""
        g = self.groups[key]
        new = replace(g, state=state, times_sampled=g.times_sampled + sampled_delta)
        self._set(new)
        return new

    def delete(self, key: int) -> Group:
        """Remove a group entirely. Raises ``KeyError`` if it is not stored."""
        g = self.groups[key]
        self.rows[g.state] -= g.num_rows
        self.count[g.state] -= 1
        if g.state == POOLED:
            self._unpool(g)
        elif g.state == EXCLUDED:
            del self.excluded[key]
        del self.groups[key]
        del self.key_of[g.group_id]
        self.nbytes -= g.nbytes
        return g

    def set_priority(self, key: int, priority: float) -> None:
        g = self.groups[key]
        if g.state == POOLED:
            self.sampler.update(key, priority)
        self.groups[key] = replace(g, priority=priority)

    def pooled_for_prompts(self, prompt_indices: list[int]) -> list[int] | None:
        """The pooled group key of each prompt index, in the given order, or ``None`` unless every one has a
        pooled group (lockstep's canonical consumption order). O(stored groups): lockstep keeps replay small."""
        by_prompt = {g.prompt_index: g.key for g in self.groups.values() if g.state == POOLED}
        keys = [by_prompt.get(i) for i in prompt_indices]
        return None if None in keys else keys

    def pooled_older_than(self, min_version: int) -> list[int]:
        """Pooled keys whose oldest token version is below ``min_version`` (too stale), oldest first."""
        out: list[int] = []
        for version in [v for v in self._pool_by_version if v < min_version]:
            out.extend(self._pool_by_version[version])
        return sorted(out)

    def eviction_candidates(self, n: int, protect: frozenset[int] = frozenset()) -> list[int]:
        """Up to ``n`` keys to evict: excluded groups first (oldest first), then by the eviction
        selector, avoiding the ``protect``ed keys (the groups just inserted) unless nothing else is left
        — Reverb's order: make room first, then insert."""
        out = list(itertools.islice(self.excluded, n))
        if len(out) < n and len(self.evictor):
            ranked = self.evictor.pick(min(len(self.evictor), n - len(out) + len(protect)))
            keep = [k for k in ranked if k not in protect] + [k for k in ranked if k in protect]
            out += keep[: n - len(out)]
        return out
