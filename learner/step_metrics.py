"""Per-step learner metrics that are not loss terms: importance-weight ESS, staleness histogram, rows from a
crashed learner's timeline, critic explained variance, and merging per-micro-batch metrics. Pure, no state."""

from __future__ import annotations

import pyarrow as pa
import torch

from gyre.proto.timeline import SHARED, UNKNOWN

STALENESS_BUCKETS = 8
"""Largest staleness bucket: lags ``>= STALENESS_BUCKETS`` are counted in ``staleness_hist_{STALENESS_BUCKETS}``."""

MAX_METRICS = ("is_ratio_max",)
"""Per-micro-batch metrics merged by ``max`` instead of the token-weighted mean."""


def kish_ess_fraction(weights: torch.Tensor) -> float:
    """Kish's effective sample size of importance weights, as a fraction of their count:
    ``(sum w)^2 / sum w^2 / N`` (Kish 1965). 1 when all weights are equal (on-policy), ``1/N`` when
    one weight carries everything.

    Args:
        weights: ``[N]`` float, non-negative (e.g. the valid tokens' ``pi_proximal / pi_behaviour``).

    Returns:
        Fraction in ``(0, 1]``; 0.0 for an empty or all-zero input.

    Raises:
        ValueError: ``weights`` is not 1-D or has a negative entry.
    """
    if weights.dim() != 1:
        raise ValueError(f"weights must be [N]; got shape {tuple(weights.shape)}")
    w = weights.double()
    if bool((w < 0).any()):
        raise ValueError(f"importance weights must be >= 0; got min {float(w.min())}")
    sq = float((w * w).sum())
    if w.numel() == 0 or sq == 0.0:
        return 0.0
    return float(w.sum()) ** 2 / sq / w.numel()


def staleness_histogram(staleness: torch.Tensor, max_bucket: int = STALENESS_BUCKETS) -> dict[str, float]:
    """Trajectory counts per policy lag: ``staleness_hist_k`` for ``k = 0 .. max_bucket``, the last
    bucket counting every lag ``>= max_bucket``, and ``staleness_negative``: trajectories with a negative
    lag (a version number the learner has not reached: sampled by weights a crashed learner published
    before this one resumed from an older checkpoint, ``proto.timeline``), which are not on-policy and so
    are in no bucket. Every key is present (0 when empty), so the metric rows have a fixed set of columns.

    Args:
        staleness: ``[B]`` int, ``learner_version - oldest version`` of each trajectory.
        max_bucket: ``>= 0``.

    Raises:
        ValueError: ``staleness`` is not 1-D or ``max_bucket`` is negative.
    """
    if staleness.dim() != 1:
        raise ValueError(f"staleness must be [B]; got shape {tuple(staleness.shape)}")
    if max_bucket < 0:
        raise ValueError(f"max_bucket ({max_bucket}) must be >= 0")
    lags = staleness.long()
    counts = torch.bincount(lags[lags >= 0].clamp(max=max_bucket), minlength=max_bucket + 1)
    return {**{f"staleness_hist_{k}": float(c) for k, c in enumerate(counts.tolist())},
            "staleness_negative": float((lags < 0).sum())}


def dead_timeline_rows(table: pa.Table, timeline: int, start_version: int) -> float:
    """Rows of a batch (``TRAJECTORY_SCHEMA``) that a crashed learner's weights sampled after the version this
    learner resumed from: ``policy_timeline`` neither ``timeline`` (this learner's), ``SHARED`` nor
    ``UNKNOWN``, and a newest span version above ``start_version`` (``proto.timeline``). Replay drops such
    rows once this learner rejoined; a count above 0 means some arrived before (or replay kept them)."""
    timelines = table.column("policy_timeline").to_pylist()
    newest = [spans[-1] for spans in table.column("version_span_versions").to_pylist()]
    return float(sum(t not in (SHARED, UNKNOWN, timeline) and v > start_version for t, v in zip(timelines, newest)))


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over valid tokens (population variances): 1 for a perfect critic,
    0 for one that predicts the mean, negative for worse. NaN when ``Var(R) == 0`` or no token is valid.

    Args:
        values: ``[B, T]`` float, critic predictions ``V``.
        returns: ``[B, T]`` float, targets ``R``.
        mask: ``[B, T]`` bool.
    """
    r = returns[mask].double()
    if r.numel() == 0:
        return float("nan")
    var_r = float(r.var(unbiased=False))
    if var_r == 0.0:
        return float("nan")
    return 1.0 - float((r - values[mask].double()).var(unbiased=False)) / var_r


def merge_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Token-weighted mean of per-micro-batch metrics (max for ``MAX_METRICS``), dropping ``valid_tokens``.

    Each part must carry ``valid_tokens``; a key missing from a part is skipped for it.
    """
    total = sum(p["valid_tokens"] for p in parts)
    merged: dict[str, float] = {}
    keys = dict.fromkeys(k for p in parts for k in p if k != "valid_tokens")
    for key in keys:
        have = [p for p in parts if key in p and p["valid_tokens"] > 0]
        if key in MAX_METRICS:
            merged[key] = max(p[key] for p in have) if have else 0.0
        else:
            weight = sum(p["valid_tokens"] for p in have)
            merged[key] = sum(p[key] * p["valid_tokens"] for p in have) / weight if total and weight else 0.0
    return merged
