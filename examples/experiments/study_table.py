"""Raw numbers and the summary plot of the lag study (docs/experiments/lag-study.md), from the runs' own files.

    python examples/experiments/study_table.py runs/lag-study --out docs/experiments/lag-study
    python examples/experiments/study_table.py runs/record-once-study runs/lag-study/lag4-behaviour-none-s0 \
        --out docs/experiments/record-once --no-plot

Writes ``runs.md`` (one row per run: its lag, correction and seed from ``recipe.json``; held-out greedy accuracy at
every evaluation; mean training reward, importance-ratio ESS, PPO-clip, TIS-clip and MIS-masked fractions over its
steps; learner seconds) and, unless ``--no-plot``, ``final_vs_lag.png``: final held-out accuracy against the lag, one
line per correction, mean over seeds with a bar from the lowest to the highest seed. ``gyre compare`` draws the
curves; this adds the per-run table and the one figure a lag study is read by.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from gyre.services.cli.compare import Run, find_runs, load_run


def finished_runs(paths: list[str]) -> list[Run]:
    """``gyre compare``'s runs under ``paths`` (run directories or directories of them), leaving out those that have
    not finished (no ``summary.json``)."""
    return [load_run(p) for p in find_runs(paths) if (p / "summary.json").is_file()]


def describe(run: Run) -> dict:
    """One run's row: settings from ``recipe.json``, numbers from ``metrics.jsonl`` (``Run.series``: one value per
    step, a re-trained step's last)."""
    recipe, algo = run.recipe, run.recipe["learner"]["algorithm"]
    # a -1 "before" evaluation (lockstep before 1af7375) is of version 0
    evals = {max(p.step, 0): p.value for p in run.series("heldout_accuracy")}

    def mean(key: str) -> float:
        return statistics.fmean(p.value for p in run.series(key))

    source = (recipe["replay"].get("source") or {}).get("recorded")
    return {"run": run.name, "lag": recipe["lockstep_lag"] if recipe["determinism"] == "lockstep" else None,
            "correction": f"{algo['policy_ratio']}/{algo['is_weight']}", "seed": recipe["seed"],
            "recorded": Path(source).name if source else None, "evals": evals,
            "reward": mean("reward_mean"), "ess": mean("is_ess_frac"), "ppo_clip": mean("ppo_clip_frac"),
            "tis_clip": mean("tis_clip_frac"), "mis_masked": mean("mis_masked_frac"),
            "learner_s": sum(p.value for p in run.series("step_s"))}


def markdown(runs: list[dict]) -> str:
    versions = sorted({v for r in runs for v in r["evals"]})
    head = ["run", "lag", "correction", "seed", "data", *(f"acc@{v}" for v in versions), "reward", "ESS",
            "PPO clip", "TIS clip", "MIS masked", "learner s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        accs = [f"{r['evals'][v]:.3f}" if v in r["evals"] else "" for v in versions]
        data = f"recording of {r['recorded']}" if r["recorded"] else "own rollouts"
        cells = [r["run"], "" if r["lag"] is None else str(r["lag"]), r["correction"], str(r["seed"]), data, *accs,
                 f"{r['reward']:.3f}", f"{r['ess']:.3f}", f"{r['ppo_clip']:.4f}", f"{r['tis_clip']:.4f}",
                 f"{r['mis_masked']:.4f}", f"{r['learner_s']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> Path:
    """Final held-out accuracy against lag, one line per correction (mean over seeds, bar: lowest to highest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        if r["lag"] is not None:
            by[r["correction"]][r["lag"]].append(r["evals"][max(r["evals"])])
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (correction, lags) in enumerate(sorted(by.items())):
        xs = sorted(lags)
        means = [statistics.fmean(lags[x]) for x in xs]
        low = [m - min(lags[x]) for m, x in zip(means, xs)]
        high = [max(lags[x]) - m for m, x in zip(means, xs)]
        ax.errorbar([x + 0.08 * (i - 1) for x in xs], means, yerr=[low, high], marker="o", capsize=4, label=correction)
    before = statistics.fmean(r["evals"][min(r["evals"])] for r in runs)
    ax.axhline(before, color="grey", linestyle=":", label=f"before training ({before:.3f})")
    ax.set_xlabel("policy lag k (lockstep)")
    ax.set_ylabel("final held-out greedy accuracy")
    ax.set_xticks(sorted({r["lag"] for r in runs if r["lag"] is not None}))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run directories or directories of runs")
    p.add_argument("--out", required=True, help="output folder for runs.md (and final_vs_lag.png)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    runs = sorted((describe(r) for r in finished_runs(args.runs)),
                  key=lambda r: (r["lag"] is None, r["lag"] or 0, r["correction"], r["seed"], r["run"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.md").write_text(markdown(runs))
    if not args.no_plot:
        plot(runs, out / "final_vs_lag.png")
    print(f"{len(runs)} runs -> {out}")


if __name__ == "__main__":
    main()
