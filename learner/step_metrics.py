"""Per-step learner metrics that are not loss terms: importance-weight ESS, staleness histogram, rows from a
crashed learner's timeline, critic explained variance, merging per-micro-batch metrics, and the batch's own metrics
(``batch_metrics``). Pure, no state."""

from __future__ import annotations

import pyarrow as pa
import torch

from gyre.learner.batch import TrainBatch, reward_error_metrics, truncation_metrics
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


def batch_metrics(batch: TrainBatch, targets, algo) -> dict[str, float]:
    """Reward, advantage, staleness (and critic, KL-in-reward) metrics of the batch itself (``targets``: the
    step's ``learner.step_start.StepTargets`` or None; ``algo``: its ``AlgorithmConfig``), and its
    ``truncated_frac`` (``overlong_penalty_mean`` with the soft overlong punishment;
    ``learner.batch.truncation_metrics``), and multi-turn episodes' metrics (``learner.batch.episode_metrics``).
    ``reward_mean`` / ``reward_std`` are the verifier's raw rewards of the rows that train, as is
    ``advantage_abs_mean``: a row whose score failed, or that the overlong filter dropped, is out of all three
    (``reward_error_frac`` counts the failed ones); 0.0 when no row trains."""
    adv, critic = batch.advantages if targets is None else targets.advantages, {}
    trained = batch.baseline_rows & ~(batch.truncated if algo.overlong_filter else torch.zeros_like(batch.truncated))
    valid = adv[batch.response_mask] if adv.dim() == 2 else adv[trained]
    adv_abs = float(valid.abs().mean()) if valid.numel() else 0.0  # 0, not NaN, when every row is filtered
    rewards = batch.rewards[trained]
    if targets is not None and targets.old_values is not None:
        critic["explained_variance"] = explained_variance(targets.old_values, targets.returns, batch.response_mask)
    if targets is not None and targets.kl_to_ref is not None:
        critic["kl_to_ref"] = targets.kl_to_ref
    return {
        "reward_mean": float(rewards.mean()) if rewards.numel() else 0.0,
        "reward_std": float(rewards.std(unbiased=False)) if rewards.numel() else 0.0,
        "advantage_abs_mean": adv_abs,
        "staleness_mean": float(batch.staleness.float().mean()),
        "staleness_max": float(batch.staleness.max()),
        **staleness_histogram(batch.staleness),
        **critic,
        **truncation_metrics(batch, algo),
        **reward_error_metrics(batch),
        **batch.episodes,
    }
