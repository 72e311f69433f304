"""Which rows each rank trains in which micro-batch: fixed row counts, or token budgets balanced over ranks.

With ``LearnerConfig.micro_batch_tokens`` (verl's dynamic batch size, ``use_dynamic_bsz``): a mini-batch's rows
are split over the data-parallel ranks with balanced token counts (Karmarkar–Karp's largest differencing method
for ``k`` subsets, as verl's ``get_seqlen_balanced_partitions``), then each rank packs its rows, longest first,
into micro-batches of at most ``micro_batch_tokens`` real tokens (first-fit decreasing). Every rank must run
the same number of micro-batches (ZeRO's collectives run per forward/backward), so a rank with fewer splits its
fullest micro-batch in two until the counts agree, and a rank left with fewer rows than micro-batches gets
empty ones (``None``: the engine runs a zero-weight forward/backward for the collectives).

Every rank computes the whole plan from the row lengths it already has (the batch is broadcast to all ranks), so
the plan costs no communication and all ranks agree on it.
"""

from __future__ import annotations

import heapq
import itertools

import torch


def karmarkar_karp(weights: list[int], k: int) -> list[list[int]]:
    """Split item indices into ``k`` subsets of near-equal weight sum (largest differencing method, Karmarkar &
    Karp 1982; the k-way form of Korf 2009 / verl). Deterministic: ties go to the lower index.

    Args:
        weights: non-negative item weights (here: row token counts).
        k: number of subsets, ``>= 1``.

    Returns:
        ``k`` lists of item indices (each sorted; a list may be empty when ``len(weights) < k``), ordered by
        subset sum, largest first.
    """
    if k < 1:
        raise ValueError(f"k {k} must be >= 1")
    counter = itertools.count()
    heap = []
    for i, w in sorted(enumerate(weights), key=lambda iw: (-iw[1], iw[0])):
        state = [(w, [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-w, next(counter), state))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]  # a: desc, b reversed: asc
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(counter), merged))
    return [sorted(items) for _, items in heap[0][2]]


def pack_by_tokens(rows: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: ``rows`` into as few bins of at most ``budget`` tokens as it finds.

    Args:
        rows: row indices; ``lengths[i]`` is row ``rows[i]``'s token count.
        budget: tokens per bin.

    Raises:
        ValueError: a row longer than ``budget`` (names the row, its length and the budget).
    """
    bins: list[tuple[int, list[int]]] = []
    for length, row in sorted(zip(lengths, rows), key=lambda lr: (-lr[0], lr[1])):
        if length > budget:
            raise ValueError(f"row {row} has {length} tokens, more than learner.engine.micro_batch_tokens "
                             f"({budget}); raise the budget to at least the longest row (prompt + max_new_tokens)")
        for i, (used, members) in enumerate(bins):
            if used + length <= budget:
                bins[i] = (used + length, members + [row])
                break
        else:
            bins.append((length, [row]))
    return [members for _, members in bins]


def _split_to(bins: list[list[int]], count: int, length: dict[int, int]) -> list[list[int] | None]:
    """``bins`` grown to ``count`` micro-batches: the fullest bin with >= 2 rows is halved (alternating rows by
    length) until ``count``; then ``None`` (empty) micro-batches."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            break
        fullest = max(splittable, key=lambda b: sum(length[r] for r in b))
        bins.remove(fullest)
        ordered = sorted(fullest, key=lambda r: (-length[r], r))
        bins += [ordered[0::2], ordered[1::2]]
    return bins + [None] * (count - len(bins))


def token_budget_plan(lengths: torch.Tensor, rows: range | list[int], world: int, budget: int
                      ) -> list[list[list[int] | None]]:
    """Every rank's micro-batches of the mini-batch ``rows`` under a token budget.

    Args:
        lengths: ``[B]`` int real tokens per row of the batch (``attention_mask.sum(1)``).
        rows: the mini-batch's row indices.
        world: data-parallel ranks sharing the rows (1: one rank takes all).
        budget: ``micro_batch_tokens``.

    Returns:
        ``plan[rank]``: that rank's micro-batches, each a list of row indices or ``None`` (empty); every rank has
        the same number of micro-batches.

    Raises:
        ValueError: a row longer than the budget.
    """
    rows = list(rows)
    length = {r: int(lengths[r]) for r in rows}
    shares = karmarkar_karp([length[r] for r in rows], world) if world > 1 else [list(range(len(rows)))]
    per_rank = [pack_by_tokens([rows[i] for i in share], [length[rows[i]] for i in share], budget)
                for share in shares]
    count = max(len(bins) for bins in per_rank)
    return [_split_to(bins, count, length) for bins in per_rank]


def row_count_plan(rows: range, world: int, micro_batch_size: int) -> list[list[list[int]]]:
    """Every rank's micro-batches of the mini-batch ``rows`` at a fixed row count: rank ``r`` takes the
    contiguous ``r``-th ``1 / world`` of the rows, cut into consecutive runs of ``micro_batch_size``.

    Raises:
        ValueError: ``len(rows)`` is not a multiple of ``world``.
    """
    if len(rows) % world:
        raise ValueError(f"mini-batch of {len(rows)} rows cannot be sharded over {world} data-parallel ranks: make "
                         f"groups_per_step * group_size / mini_batches a multiple of {world}, set "
                         "learner.engine.micro_batch_tokens (token-balanced shares), or batch_split: replicate")
    share = len(rows) // world
    out = []
    for rank in range(world):
        mine = list(rows)[rank * share:(rank + 1) * share]
        out.append([mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)])
    return out
