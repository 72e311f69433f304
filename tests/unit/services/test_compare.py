"""``gyre compare`` on synthetic run directories whose final / best / AUC / threshold values are computed by hand."""

import csv
import io
import json
import math

import pytest
from rich.console import Console

from gyre.services.cli.compare import (CompareError, compare, compare_table, find_runs, group_runs, load_run,
                                  markdown_table, parse_thresholds, run_stats)
from gyre.services.cli.main import main as gyre_main


def _run(root, name, rewards, step_s, lag=0, determinism="lockstep", seed=0, evals=None, **extra_rows):
    """A run dir: training rows at steps 1..n (reward_mean, staleness_mean, step_s) and evaluation rows."""
    out = root / name
    out.mkdir(parents=True)
    rows = [{"step": 0, "eval": "before", "heldout_accuracy": (evals or [0.0])[0]}]
    for step, (reward, secs) in enumerate(zip(rewards, step_s), 1):
        rows.append({"step": step, "loss": 0.1, "reward_mean": reward, "staleness_mean": min(step - 1, lag),
                     "step_s": secs, "time": 1.0e9 + step, **{k: v[step - 1] for k, v in extra_rows.items()}})
    if evals:
        rows.append({"step": len(rewards), "eval": "after", "heldout_accuracy": evals[1]})
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {"name": name, "seed": seed, "determinism": determinism, "lockstep_lag": lag,
              "learner": {"algorithm": {"is_weight": "tis_token"}}}
    (out / "recipe.json").write_text(json.dumps(recipe))
    return out


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "sweep"
    _run(root, "a", [0.2, 0.6, 0.4], [10, 10, 20], lag=0, evals=[0.0, 0.5])
    _run(root, "b", [0.4, 0.8, 0.8], [5, 5, 5], lag=0, seed=1, evals=[0.1, 0.7])
    _run(root, "c", [0.0, 0.1, 0.2], [1, 1, 1], lag=2)
    (root / "logs").mkdir()  # a sweep directory also holds logs/ and sweep.json: not runs
    (root / "sweep.json").write_text("{}")
    return root


def _row(table, group, metric):
    return next(r for r in table if r["group"] == group and r["metric"] == metric)


def test_final_best_auc_and_threshold_per_group(runs):
    groups = group_runs([load_run(p) for p in find_runs([runs])], ["lockstep_lag"])
    assert {k: [r.name for r in v] for k, v in groups.items()} == {"lockstep_lag=0": ["a", "b"],
                                                                   "lockstep_lag=2": ["c"]}
    table = compare_table(groups, ["reward_mean", "heldout_accuracy", "staleness_mean"], {"reward_mean": 0.5})
    r = _row(table, "lockstep_lag=0", "reward_mean")
    # a: final 0.4, best 0.6, AUC ((0.2+0.6)/2 + (0.6+0.4)/2) / 2 = 0.45, reaches 0.5 at step 2 after 10+10 s
    # b: final 0.8, best 0.8, AUC ((0.4+0.8)/2 + (0.8+0.8)/2) / 2 = 0.7,  reaches 0.5 at step 2 after 5+5 s
    assert r["runs"] == 2 and r["run_names"] == "a;b"
    assert r["final_mean"] == pytest.approx(0.6) and r["final_std"] == pytest.approx(math.sqrt(0.08))
    assert (r["final_min"], r["final_max"]) == (0.4, 0.8)
    assert r["best_mean"] == pytest.approx(0.7) and r["auc_mean"] == pytest.approx(0.575)
    assert (r["auc_min"], r["auc_max"]) == (pytest.approx(0.45), pytest.approx(0.7))
    assert r["reached"] == "2/2" and r["step_to_threshold_mean"] == 2 and r["time_to_threshold_s_mean"] == 15
    c = _row(table, "lockstep_lag=2", "reward_mean")  # one run: no spread; AUC (0.05 + 0.15) / 2; never 0.5
    assert c["final_mean"] == 0.2 and c["final_std"] is None and c["auc_mean"] == pytest.approx(0.1)
    assert c["reached"] == "0/1" and c["step_to_threshold_mean"] is None
    acc = _row(table, "lockstep_lag=0", "heldout_accuracy")  # evaluations at step 0 and 3
    assert acc["final_mean"] == pytest.approx(0.6) and acc["auc_mean"] == pytest.approx((0.25 + 0.4) / 2)
    lag = _row(table, "lockstep_lag=2", "staleness_mean")  # lower is better: best is the lowest lag
    assert lag["best_mean"] == 0 and lag["final_mean"] == 2


def test_a_step_trained_twice_counts_once_with_its_last_value_and_both_durations(tmp_path):
    out = _run(tmp_path, "r", [0.2, 0.9], [4, 6])
    with (out / "metrics.jsonl").open("a") as f:  # a learner rewind: step 2 again, then step 3
        f.write(json.dumps({"step": 2, "loss": 0.1, "reward_mean": 0.5, "step_s": 7}) + "\n")
        f.write(json.dumps({"step": 3, "loss": 0.1, "reward_mean": None, "step_s": 1}) + "\n")  # NaN written as null
    points = load_run(out).series("reward_mean")
    assert [(p.step, p.wall_s, p.value) for p in points] == [(1, 4, 0.2), (2, 17, 0.5)]


def test_threshold_of_a_lower_is_better_metric_is_reached_from_above():
    from gyre.services.cli.compare import Point

    pts = [Point(1, 1.0, 0.9), Point(2, 2.0, 0.3), Point(3, 3.0, 0.1)]
    assert run_stats(pts, "approx_kl", 0.3) == {"final": 0.1, "best": 0.1, "auc": pytest.approx(0.4),
                                                "step_to_threshold": 2, "time_to_threshold_s": 2.0}
    assert run_stats(pts, "reward_mean", 0.3)["step_to_threshold"] == 1
    assert run_stats(pts[:1], "reward_mean")["auc"] == 0.9  # one point: its value


def test_compare_writes_pngs_and_the_markdown_and_csv_tables(runs, tmp_path):
    out = tmp_path / "cmp"
    files = compare([str(runs)], ["lockstep_lag"], [], {"reward_mean": 0.5}, out, Console(file=io.StringIO()))
    # the default metrics these runs have (no IS, clip, ESS or KL keys here)
    assert sorted(f.name for f in files) == ["compare.csv", "compare.md", "heldout_accuracy.png", "reward_mean.png",
                                             "staleness_mean.png"]
    assert all(f.stat().st_size > 0 for f in files)
    assert (out / "reward_mean.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "compare.md").read_text()
    assert md.startswith("# gyre compare: 3 runs, grouped by lockstep_lag\n")
    assert "| lockstep_lag=0 | reward_mean | 2 | 0.6 ± 0.2828 | 0.7 ± 0.1414 | 0.575 ± 0.1768 | 0.5 | 2/2 | 2 | 15 |" in md
    rows = list(csv.DictReader((out / "compare.csv").open()))
    r = next(r for r in rows if r["group"] == "lockstep_lag=0" and r["metric"] == "reward_mean")
    assert float(r["auc_mean"]) == pytest.approx(0.575) and r["reached"] == "2/2" and r["final_std"] != ""
    assert next(r for r in rows if r["metric"] == "staleness_mean")["threshold"] == ""


def test_gyre_compare_on_the_command_line(runs, tmp_path, capsys):
    out = tmp_path / "cli"
    assert gyre_main(["compare", str(runs / "a"), str(runs / "b"), "--by", "learner.algorithm.is_weight", "--by", "seed",
                      "--metric", "reward_mean", "--threshold", "reward_mean=0.5", "--out", str(out)]) == 0
    md = (out / "compare.md").read_text()
    assert "| learner.algorithm.is_weight=tis_token, seed=0 | reward_mean | 1 | 0.4 |" in md
    assert (out / "reward_mean.png").is_file() and not (out / "staleness_mean.png").exists()
    assert gyre_main(["compare", str(runs), "--metric", "nope", "--out", str(out)]) == 2
    assert "--metric nope: no run has it" in " ".join(capsys.readouterr().out.split())


def test_without_by_each_run_is_its_own_group(runs):
    groups = group_runs([load_run(p) for p in find_runs([runs / "c", runs / "a"])], [])
    assert list(groups) == ["c", "a"]
    assert "| a | reward_mean | 1 | 0.4 | 0.6 | 0.45 |" in markdown_table(compare_table(groups, ["reward_mean"], {}))


def test_refusals_name_the_run_and_key(runs, tmp_path):
    _run(tmp_path / "other", "async", [0.1], [1], determinism="async")
    all_runs = [load_run(p) for p in find_runs([runs, tmp_path / "other"])]
    with pytest.raises(CompareError, match=r"--by lockstep_lag: run .*async is not a lockstep run \(determinism: "
                                           r"async\), so lockstep_lag is not its policy lag"):
        group_runs(all_runs, ["lockstep_lag"])
    with pytest.raises(CompareError, match=r"--by learner.nope: run .*/a's recipe.json has no such key"):
        group_runs(all_runs, ["learner.nope"])
    with pytest.raises(CompareError, match=r"is not a run directory \(no metrics.jsonl\) and holds none"):
        find_runs([runs / "logs"])
    with pytest.raises(CompareError, match=r"--threshold 'reward_mean': expected METRIC=NUMBER"):
        parse_thresholds(["reward_mean"])
    with pytest.raises(CompareError, match=r"--threshold 'reward_mean=high': expected METRIC=NUMBER"):
        parse_thresholds(["reward_mean=high"])
    with pytest.raises(CompareError, match=r"--threshold approx_kl: not among the compared metrics"):
        compare([str(runs)], [], ["reward_mean"], {"approx_kl": 0.1}, tmp_path / "x", Console(file=io.StringIO()))
