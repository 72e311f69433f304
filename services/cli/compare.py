"""``gyre compare RUN_DIR... [--by KEY] [--metric M] [--threshold M=V] [--out DIR]``: overlay runs' metrics
against learner step and wall time, grouped by a recipe key, with a table of final / best / area under the
curve / step and time to a threshold per group, as Markdown and CSV beside one PNG per metric.

What is read from each run directory (``runs/<name>/``, or every run of a sweep directory holding ``sweep.json``):
``metrics.jsonl`` (``services.control.outputs.report``) and ``recipe.json``, the resolved recipe ``gyre run`` wrote, for
``--by`` (a dotted key: ``lockstep_lag``, ``learner.algorithm.is_weight``).

Definitions (per run, then mean, sample standard deviation, min and max over the runs of a group — its seeds and
whatever other keys it is not grouped by):

- a metric's points: every row holding it as a number, one per ``step`` (the last row of a step wins: a step
  re-trained after a learner rewind); evaluation rows (``heldout_accuracy``, ...) sit at their policy version;
- wall time of a row: the sum of the learner's ``step_s`` over the training rows written up to it (seconds of
  training: sampling wait, update, publish, checkpoint), so a run's start-up, the evaluation before training
  and time spent stopped between resumes do not count;
- final: the value at the last step; best: the highest value (the lowest for ``LOWER_IS_BETTER`` metrics);
- AUC: the trapezoid integral over steps divided by the step span (the step-weighted mean; a single point's
  value when there is one point);
- threshold ``M=V``: the first step (and its wall time) whose value reaches ``V`` (``>= V``, ``<= V`` for
  ``LOWER_IS_BETTER`` metrics); runs that never reach it are counted in ``reached`` and left out of the mean.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from gyre.services.control.outputs.run_dir import RunDirError, read_recipe_if_any

DEFAULT_METRICS = ("reward_mean", "heldout_accuracy", "staleness_mean", "is_ratio_mean", "ppo_clip_frac",
                   "tis_clip_frac", "is_ess_frac", "approx_kl", "kl_to_ref")
"""Compared when no ``--metric`` is given, each where some run has it: training reward, greedy held-out accuracy,
policy lag of the trained tokens, mean importance ratio π_proximal/π_behaviour, PPO-clipped and TIS-truncated
token fractions, Kish ESS of the importance weights, k3 KL to the proximal policy and to the reference."""
LOWER_IS_BETTER = ("*kl*", "staleness*", "*clip_frac", "loss", "mis_masked_frac", "truncated_frac", "episode_broken_frac",
                   "episode_max_turns_frac", "tool_error_frac")
"""``fnmatch`` patterns of metrics whose best value is the lowest and whose threshold is reached from above."""


class CompareError(ValueError):
    """Runs that cannot be compared as asked; the message names the run, key or metric."""


@dataclass(frozen=True)
class Point:
    step: int
    wall_s: float
    """Seconds of training up to this row (see the module docstring)."""
    value: float


@dataclass(frozen=True)
class Run:
    name: str
    path: Path
    rows: list[dict]
    """``metrics.jsonl``'s rows, in file order."""
    recipe: dict | None
    """``recipe.json`` (``None`` when the run has none)."""

    def series(self, metric: str) -> list[Point]:
        """The metric's points, one per step, sorted by step."""
        by_step: dict[int, Point] = {}
        wall = 0.0
        for row in self.rows:
            if "loss" in row and _number(row.get("step_s")):
                wall += row["step_s"]
            if _number(row.get(metric)) and isinstance(row.get("step"), int):
                by_step[row["step"]] = Point(row["step"], wall, float(row[metric]))
        return [by_step[s] for s in sorted(by_step)]

    def key(self, dotted: str):
        """The recipe's value at a dotted key. Raises ``CompareError`` (no recipe.json, or no such key)."""
        if self.recipe is None:
            raise CompareError(f"run {self.path} has no recipe.json to read --by {dotted} from")
        node = self.recipe
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                raise CompareError(f"--by {dotted}: run {self.path}'s recipe.json has no such key")
            node = node[part]
        if dotted == "lockstep_lag" and self.recipe.get("determinism") != "lockstep":
            raise CompareError(f"--by lockstep_lag: run {self.path} is not a lockstep run (determinism: "
                               f"{self.recipe.get('determinism')}), so lockstep_lag is not its policy lag")
        return node


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Run directories named by ``paths``: a run directory (it has ``metrics.jsonl``), or a sweep directory
    (``sweep.json``) or any directory whose subdirectories are runs — each of those runs, sorted by name.

    Raises:
        CompareError: a path that is none of these.
    """
    out: list[Path] = []
    for path in map(Path, paths):
        if (path / "metrics.jsonl").is_file():
            found = [path]
        else:
            found = sorted(p for p in path.glob("*/") if (p / "metrics.jsonl").is_file()) if path.is_dir() else []
        if not found:
            raise CompareError(f"{path} is not a run directory (no metrics.jsonl) and holds none")
        out += [p for p in found if p not in out]
    return out


def load_run(path: Path) -> Run:
    """Read a run directory. Raises ``CompareError`` naming a line of ``metrics.jsonl`` that is not JSON."""
    rows = []
    for i, line in enumerate((path / "metrics.jsonl").read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise CompareError(f"{path / 'metrics.jsonl'}:{i} is not JSON: {exc}") from None
    try:
        recipe = read_recipe_if_any(path)
    except RunDirError as exc:
        raise CompareError(str(exc)) from None
    return Run(path.name, path, [r for r in rows if isinstance(r, dict)], recipe)


def _sort_key(value) -> tuple:
    return (0, value, "") if _number(value) else (1, 0, json.dumps(value, sort_keys=True, default=str))


def group_runs(runs: list[Run], by: list[str]) -> dict[str, list[Run]]:
    """Group label (``key=value, ...``; the run's name without ``by``) → its runs, ordered by the key values."""
    if not by:
        return {run.name: [run] for run in runs}
    keyed = sorted(((tuple(run.key(k) for k in by), run) for run in runs),
                   key=lambda item: tuple(_sort_key(v) for v in item[0]))
    groups: dict[str, list[Run]] = {}
    for values, run in keyed:
        label = ", ".join(f"{k}={v}" for k, v in zip(by, values))
        groups.setdefault(label, []).append(run)
    return groups


def lower_is_better(metric: str) -> bool:
    return any(fnmatch.fnmatchcase(metric, p) for p in LOWER_IS_BETTER)


def run_stats(points: list[Point], metric: str, threshold: float | None = None) -> dict[str, float | None]:
    """One run's ``final``, ``best``, ``auc`` and, with a threshold, ``step_to_threshold`` and
    ``time_to_threshold_s`` (``None``: not reached) of a metric's points (at least one)."""
    values = [p.value for p in points]
    low = lower_is_better(metric)
    span = points[-1].step - points[0].step
    area = sum((b.step - a.step) * (a.value + b.value) / 2 for a, b in zip(points, points[1:]))
    out: dict[str, float | None] = {"final": values[-1], "best": min(values) if low else max(values),
                                    "auc": area / span if span else values[0]}
    if threshold is not None:
        hit = next((p for p in points if (p.value <= threshold if low else p.value >= threshold)), None)
        out["step_to_threshold"] = hit.step if hit else None
        out["time_to_threshold_s"] = hit.wall_s if hit else None
    return out


STATS = ("final", "best", "auc")


def _spread(values: list[float]) -> dict[str, float | None]:
    return {"mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values, default=None), "max": max(values, default=None)}


def compare_table(groups: dict[str, list[Run]], metrics: list[str], thresholds: dict[str, float]) -> list[dict]:
    """One row per (group, metric) that some run of the group has: ``runs`` (how many have the metric),
    ``{final,best,auc}_{mean,std,min,max}``, and for a metric with a threshold ``threshold``, ``reached``
    (``k/n``), ``step_to_threshold_mean``, ``time_to_threshold_s_mean``."""
    table = []
    for label, runs in groups.items():
        for metric in metrics:
            per_run = [(run, run_stats(pts, metric, thresholds.get(metric)))
                       for run in runs if (pts := run.series(metric))]
            if not per_run:
                continue
            row: dict = {"group": label, "metric": metric, "runs": len(per_run),
                         "run_names": ";".join(run.name for run, _ in per_run)}
            for stat in STATS:
                for agg, value in _spread([s[stat] for _, s in per_run]).items():
                    row[f"{stat}_{agg}"] = value
            if metric in thresholds:
                steps = [s["step_to_threshold"] for _, s in per_run if s["step_to_threshold"] is not None]
                times = [s["time_to_threshold_s"] for _, s in per_run if s["time_to_threshold_s"] is not None]
                row.update(threshold=thresholds[metric], reached=f"{len(steps)}/{len(per_run)}",
                           step_to_threshold_mean=statistics.fmean(steps) if steps else None,
                           time_to_threshold_s_mean=statistics.fmean(times) if times else None)
            table.append(row)
    return table


CSV_COLUMNS = ("group", "metric", "runs", *(f"{s}_{a}" for s in STATS for a in ("mean", "std", "min", "max")),
               "threshold", "reached", "step_to_threshold_mean", "time_to_threshold_s_mean", "run_names")


def write_csv(table: list[dict], path: Path) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, restval="")
        writer.writeheader()
        for row in table:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return path


def _fmt(value) -> str:
    return "–" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _pm(row: dict, stat: str) -> str:
    std = row[f"{stat}_std"]
    return _fmt(row[f"{stat}_mean"]) + (f" ± {_fmt(std)}" if std is not None else "")


def markdown_table(table: list[dict]) -> str:
    """The table as Markdown: mean ± sample std over the group's runs; threshold columns when any is set."""
    thresholds = any("threshold" in r for r in table)
    head = ["group", "metric", "runs", "final", "best", "AUC / step"]
    head += ["threshold", "reached", "step to threshold", "time to threshold (s)"] if thresholds else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        cells = [r["group"], r["metric"], str(r["runs"]), _pm(r, "final"), _pm(r, "best"), _pm(r, "auc")]
        if thresholds:
            cells += [_fmt(r.get("threshold")), r.get("reached", "–"), _fmt(r.get("step_to_threshold_mean")),
                      _fmt(r.get("time_to_threshold_s_mean"))]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def slug(metric: str) -> str:
    """A file name stem for a metric key (``eval/math/pass@4`` → ``eval_math_pass_4``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", metric).strip("_") or "metric"


def parse_thresholds(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        metric, sep, value = item.partition("=")
        try:
            out[metric] = float(value)
        except ValueError:
            sep = ""
        if not sep or not metric:
            raise CompareError(f"--threshold {item!r}: expected METRIC=NUMBER, e.g. reward_mean=0.5")
    return out


def compare(paths: list[str], by: list[str], metrics: list[str], thresholds: dict[str, float], out: Path,
            console: Console) -> list[Path]:
    """Load, group, tabulate and plot (see the module docstring); returns the files written into ``out``.

    Raises:
        CompareError: a path with no runs, a run without the ``--by`` key, a ``--metric`` no run has.
    """
    from gyre.services.cli.compare_plot import plot_metric

    runs = [load_run(p) for p in find_runs(paths)]
    groups = group_runs(runs, by)
    present = {k for run in runs for row in run.rows for k, v in row.items() if _number(v)}
    missing = [m for m in metrics if m not in present]
    if missing:
        raise CompareError(f"--metric {missing[0]}: no run has it; some they have: "
                           f"{', '.join(sorted(present)[:40])}")
    chosen = list(metrics) or [m for m in DEFAULT_METRICS if m in present]
    for metric in thresholds:
        if metric not in chosen:
            raise CompareError(f"--threshold {metric}: not among the compared metrics {chosen}")
    out.mkdir(parents=True, exist_ok=True)
    table = compare_table(groups, chosen, thresholds)
    files = [plot_metric(groups, metric, out / f"{slug(metric)}.png") for metric in chosen]
    (out / "compare.md").write_text(f"# gyre compare: {len(runs)} runs"
                                    + (f", grouped by {', '.join(by)}" if by else "") + "\n\n" + markdown_table(table))
    files += [out / "compare.md", write_csv(table, out / "compare.csv")]
    console.print(markdown_table(table), highlight=False, soft_wrap=True)
    return files


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``gyre compare RUN_DIR... [--by KEY] [--metric M] [--threshold M=V] [--out DIR]``."""
    p = sub.add_parser("compare", help="overlay runs' metrics against step and wall time, grouped by a recipe key; "
                                       "PNGs + a Markdown and CSV table (final, best, AUC, time to a threshold)")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories, or a sweep directory (its runs)")
    p.add_argument("--by", action="append", default=[], metavar="KEY",
                   help="group runs by this recipe key (dotted, from each run's recipe.json, e.g. lockstep_lag or "
                        "learner.algorithm.is_weight); repeatable; mean ± spread over each group's runs")
    p.add_argument("--metric", action="append", default=[], metavar="M",
                   help=f"a metrics.jsonl key to compare; repeatable (default: those of {', '.join(DEFAULT_METRICS)} "
                        "that the runs have)")
    p.add_argument("--threshold", action="append", default=[], metavar="M=V",
                   help="report the step and wall time at which metric M first reaches V; repeatable")
    p.add_argument("--out", default="compare", help="output folder for the PNGs, compare.md and compare.csv")


def main(args: argparse.Namespace, console: Console) -> int:
    """``gyre compare``: 0 written, 2 bad runs or arguments (the message names them)."""
    try:
        files = compare(args.runs, args.by, args.metric, parse_thresholds(args.threshold), Path(args.out), console)
    except CompareError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        return 2
    console.print("wrote " + ", ".join(str(f) for f in files), highlight=False, soft_wrap=True)
    return 0
