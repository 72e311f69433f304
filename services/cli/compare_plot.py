"""``gyre compare``'s PNGs: one per metric, against learner step (left) and wall time (right), one line per
group (the mean over its runs at each step) with a band from the lowest to the highest run (matplotlib, Agg)."""

from __future__ import annotations

import statistics
from pathlib import Path


def group_curve(runs: list, metric: str) -> list[tuple[int, float, float, float, float]]:
    """A group's curve (``runs``: ``services.cli.compare.Run``s): for every step some run has the metric at, ``(step, mean wall time (s), mean, min, max)``
    over the runs that have that step."""
    at: dict[int, list] = {}
    for run in runs:
        for p in run.series(metric):
            at.setdefault(p.step, []).append(p)
    return [(step, statistics.fmean(p.wall_s for p in pts), statistics.fmean(p.value for p in pts),
             min(p.value for p in pts), max(p.value for p in pts)) for step, pts in sorted(at.items())]


def plot_metric(groups: dict[str, list], metric: str, out_png: Path) -> Path:
    """Write ``out_png``: ``metric`` per group against step and against wall time, mean ± min/max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for i, (label, runs) in enumerate(groups.items()):
        curve = group_curve(runs, metric)
        if not curve:
            continue
        steps, walls, means, lows, highs = zip(*curve)
        n = sum(1 for run in runs if run.series(metric))
        style = dict(color=f"C{i % 10}", marker="o" if len(curve) < 20 else None, markersize=3)
        by_step.plot(steps, means, label=f"{label} (n={n})", **style)
        by_time.plot(walls, means, **style)
        if n > 1:
            by_step.fill_between(steps, lows, highs, color=f"C{i % 10}", alpha=0.2, linewidth=0)
            by_time.fill_between(walls, lows, highs, color=f"C{i % 10}", alpha=0.2, linewidth=0)
    by_step.set_xlabel("learner step (policy version)")
    by_time.set_xlabel("wall time: seconds of training (cumulative learner step_s)")
    by_step.set_ylabel(metric)
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    if by_step.get_legend_handles_labels()[0]:
        by_step.legend(fontsize="small")
    fig.suptitle(f"{metric}: mean over each group's runs, band: min–max")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
