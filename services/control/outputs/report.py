"""Run outputs: ``metrics.jsonl`` (one JSON object per line), a PNG plot of reward and accuracy, and the PNGs of
``gyre report`` (one per panel, plus where each step's time goes)."""

from __future__ import annotations

import fnmatch
import json
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.services.common.run_files import LEARNER_ROWS

if TYPE_CHECKING:
    from gyre.services.control.outputs.tracking import Trackers


class MetricsWriter:
    """Appends one JSON object per line to ``path``, flushed per row so a crash keeps what was written, and hands
    each row to the experiment trackers (``trackers``, a ``services.control.outputs.tracking.Trackers``; ``None``: none).
    Closing it closes the file only: the controller closes the trackers after the run's summary."""

    def __init__(self, path: Path, trackers: Trackers | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")
        self.trackers = trackers

    def write(self, row: dict, completions: list[dict] | None = None) -> None:
        """Append ``row``; the trackers get its metrics and, for an evaluation's row, a table of its
        ``completions`` (``EvalResult.completions``) at its step."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._f.write(json.dumps(clean, sort_keys=True) + "\n")
        self._f.flush()
        if self.trackers is not None:
            self.trackers.log_row(row)
            if completions:
                self.trackers.log_completions(completions, row["step"])

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict]:
    """Rows of a ``metrics.jsonl``. Raises ``ValueError`` naming the line that is not JSON."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i} is not JSON: {exc}") from exc
    return rows


def learner_step_summary(rows: list[dict]) -> dict[str, float]:
    """The learner's step time over a run's ``metrics.jsonl`` rows (training rows: those with ``step_time_s``):
    ``learner_step_time_s_median`` (``LearnerEngine.train_step``, seconds), ``learner_forward_backward_s_median``
    (``time/learner/forward_backward_s``), ``learner_tokens_per_s_median`` and ``learner_steps`` (rows counted);
    ``{}`` when no row trained. Medians, so a first step's warm-up or a restart does not move them."""
    steps = [r for r in rows if isinstance(r.get("step_time_s"), (int, float))]
    if not steps:
        return {}

    def median(key: str) -> float:
        return float(statistics.median(r[key] for r in steps if isinstance(r.get(key), (int, float))) or 0.0)

    out = {"learner_steps": float(len(steps)), "learner_step_time_s_median": median("step_time_s")}
    if any("time/learner/forward_backward_s" in r for r in steps):
        out["learner_forward_backward_s_median"] = median("time/learner/forward_backward_s")
    if any("tokens_per_s" in r for r in steps):
        out["learner_tokens_per_s_median"] = median("tokens_per_s")
    return out


def recover_rows(run_dir: Path, metrics: MetricsWriter, learner_version: int) -> list[int]:
    """Write to ``metrics`` the learner's rows (``{run_dir}/learner_rows.jsonl``, ``LEARNER_ROWS``) of the steps after
    the last one ``metrics.jsonl`` holds, up to ``learner_version``: steps an earlier learner finished after its
    driver was killed, and that no driver wrote. Each such row is written as the learner produced it, with
    ``"recovered": true`` (the driver's rollout columns are missing). For a step trained more than once (a learner
    that resumed from an earlier checkpoint) the later row wins; a torn last line (a learner killed mid-write) is
    skipped. Call it before training resumes (the resumed learner writes the steps after ``learner_version``).
    Returns the steps written."""
    source = Path(run_dir) / LEARNER_ROWS
    if not source.is_file():
        return []
    last = max((r["step"] for r in read_metrics(metrics.path) if "loss" in r), default=-1) \
        if metrics.path.is_file() else -1
    rows: dict[int, dict] = {}
    lines = source.read_text().splitlines()
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue  # torn by a kill while writing
            raise ValueError(f"{source}:{i + 1} is not JSON") from None
        if last < row["step"] <= learner_version:
            rows[row["step"]] = row
    for step in sorted(rows):
        metrics.write({**rows[step], "recovered": True})
    return sorted(rows)


def plot_run(metrics_path: Path, out_png: Path) -> Path:
    """Reward mean per step and the evaluations against step, as a PNG: held-out greedy accuracy, pass@k
    (with sampled evaluations) and each eval set's greedy accuracy (with more than one set)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [r for r in rows if "reward_mean" in r and "heldout_accuracy" not in r]
    evals = sorted((r for r in rows if "heldout_accuracy" in r), key=lambda r: r["step"])
    fig, ax = plt.subplots(figsize=(7, 4))
    steps, rewards = [r["step"] for r in train], [r["reward_mean"] for r in train]
    ax.plot(steps, rewards, alpha=0.35, label="train reward (batch mean)")
    window = 10
    if len(rewards) >= window:
        smooth = [sum(rewards[i - window:i]) / window for i in range(window, len(rewards) + 1)]
        ax.plot(steps[window - 1:], smooth, label=f"train reward ({window}-step mean)")
    ax.plot([r["step"] for r in evals], [r["heldout_accuracy"] for r in evals], "o--", label="held-out accuracy (greedy)")
    for key in expand_keys(["heldout_pass@*", "eval/*/greedy_accuracy"], evals):
        if key.startswith("eval/") and len(expand_keys(["eval/*/greedy_accuracy"], evals)) < 2:
            continue  # one set: its greedy accuracy is the line above
        points = [(r["step"], r[key]) for r in evals if isinstance(r.get(key), (int, float))]
        ax.plot(*zip(*points), "o:", label=key.replace("/greedy_accuracy", " greedy").removeprefix("eval/"))
    ax.set_xlabel("learner step (policy version)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(Path(metrics_path).parent.name)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)


REPORT_PANELS = {
    "reward": ("train reward (batch mean)", ["reward_mean"]),
    "accuracy": ("held-out accuracy", ["heldout_accuracy", "heldout_mean@*", "heldout_pass@*",
                                       "eval/*/greedy_accuracy", "eval/*/mean@*", "eval/*/pass@*"]),
    "staleness": ("policy lag of trained tokens (versions)", ["staleness_mean", "staleness_max"]),
    "throughput": ("tokens per second", ["tokens_per_s", "rollout_tokens_per_s"]),
}
"""``gyre report`` PNGs: file stem → (title, metrics.jsonl keys plotted against ``step``; a ``*`` matches any
characters, ``fnmatch`` style: ``eval/*/pass@*`` is every eval set's pass@k)."""


def expand_keys(patterns: list[str], rows: list[dict]) -> list[str]:
    """The keys of ``rows`` matching each pattern (``fnmatch``), in pattern order, each once, sorted within a
    pattern; a pattern without ``*`` is kept as is."""
    present = sorted({k for r in rows for k in r})
    out: list[str] = []
    for pattern in patterns:
        for key in ([pattern] if "*" not in pattern else [k for k in present if fnmatch.fnmatchcase(k, pattern)]):
            if key not in out:
                out.append(key)
    return out


def panel_points(keys: list[str], rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The lines of one ``gyre report`` panel: each key ``keys`` names (``expand_keys``) that some row holds as a
    number → its ``(step, value)`` points, sorted by step."""
    out = {}
    for key in expand_keys(keys, rows):
        points = sorted((r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)))
        if points:
            out[key] = points
    return out


def plot_report(metrics_path: Path, out_dir: Path) -> list[Path]:
    """One PNG per ``REPORT_PANELS`` entry (``{out_dir}/{stem}.png``), each key a line against step, and
    ``time_breakdown.png`` (``plot_time_breakdown``).

    Raises:
        FileNotFoundError: ``metrics_path`` does not exist.
        ValueError: a line is not JSON, or no row has a ``step`` (nothing to plot).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_path = Path(metrics_path)
    if not metrics_path.is_file():
        raise FileNotFoundError(f"no metrics file at {metrics_path}")
    rows = [r for r in read_metrics(metrics_path) if "step" in r]
    if not rows:
        raise ValueError(f"{metrics_path} has no rows with a 'step' to plot")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem, (title, keys) in REPORT_PANELS.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, points in panel_points(keys, rows).items():
            ax.plot(*zip(*points), "o-" if len(points) < 20 else "-", label=key)
        ax.set_xlabel("learner step (policy version)")
        ax.set_title(f"{metrics_path.parent.name}: {title}")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / f"{stem}.png", dpi=100)
        plt.close(fig)
        paths.append(out_dir / f"{stem}.png")
    paths.append(plot_time_breakdown(rows, out_dir / "time_breakdown.png", metrics_path.parent.name))
    return paths


LEARNER_TIME_KEYS = [f"time/learner/{p}_s" for p in ("wait_data", "forward_backward", "optimizer", "checkpoint",
                                                     "publish_blocking", "other")]
"""The stacked parts of a learner step in ``time_breakdown.png`` (``learner.step_timer``): they sum to its
``time/learner/step_s``."""
ROLLOUT_TIME_KEYS = [f"time/rollout/{p}_s" for p in ("generate", "score", "insert", "weight_apply")]
"""The rollout phases per learner step in ``time_breakdown.png`` (``services.control.orchestration.rollout_time``)."""


def plot_time_breakdown(rows: list[dict], out_png: Path, title: str) -> Path:
    """``time_breakdown.png``: per learner step, a stacked bar of its phases (``LEARNER_TIME_KEYS``, seconds) and,
    below, a stacked bar of the fleet's rollout seconds in that step (``ROLLOUT_TIME_KEYS``, summed over rollouts;
    a rollout's phases overlap, so the bar's height is work, not wall time) against a line of the step's wall
    time times the number of rollouts (what the fleet would have if it never idled). Rows lacking a panel's keys
    (older runs, evaluation rows) are left out of that panel; a panel with none says so."""
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for ax, keys, what in ((top, LEARNER_TIME_KEYS, "learner step"), (bottom, ROLLOUT_TIME_KEYS, "rollouts")):
        have = sorted((r for r in rows if all(isinstance(r.get(k), (int, float)) for k in keys)),
                      key=lambda r: r["step"])
        steps, base = [r["step"] for r in have], [0.0] * len(have)
        for key in keys:
            heights = [r[key] for r in have]
            if have:
                ax.bar(steps, heights, bottom=base, width=0.8, label=key.split("/")[-1].removesuffix("_s"))
            base = [b + h for b, h in zip(base, heights)]
        if not have:
            ax.text(0.5, 0.5, f"no {what} times in these rows", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel("seconds")
        ax.grid(alpha=0.3, axis="y")
    fleet = [(r["step"], r["time/learner/step_s"] * len(r["rollout_versions"])) for r in rows
             if isinstance(r.get("time/learner/step_s"), (int, float)) and r.get("rollout_versions")
             and all(k in r for k in ROLLOUT_TIME_KEYS)]
    if fleet:
        bottom.plot(*zip(*sorted(fleet)), "k.--", label="step wall time x rollouts")
    top.set_title(f"{title}: where a learner step's time goes")
    bottom.set_title("rollout work during the step (summed over rollouts; phases overlap)")
    bottom.set_xlabel("learner step (policy version)")
    for ax in (top, bottom):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # beside: bars stay visible
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
