"""The study's sweep files (``examples/experiments``, docs/experiments/lag-study.md): every cell's recipe loads, the
cells are the study's 3 lags × 3 corrections × 2 seeds, and the record-once sweep trains the other two corrections
on one of its runs' recording."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from gyre.services.cli.sweep import plan_sweep
from gyre.services.cli.sweep_config import read_sweep

STUDY = "examples/experiments/lag-study.yaml"
RECORD_ONCE = "examples/experiments/record-once-study.yaml"


def test_the_lag_study_is_three_lags_by_three_corrections_by_two_seeds():
    plan = plan_sweep(STUDY, full=False)
    cells = {(c.overrides["lockstep_lag"], c.overrides["learner.algorithm.policy_ratio"],
              c.overrides["learner.algorithm.is_weight"], c.overrides["seed"]) for c in plan.cells}
    assert len(plan.cells) == len(cells) == 18
    assert {c[0] for c in cells} == {0, 2, 4} and {c[3] for c in cells} == {0, 1}
    assert {c[1:3] for c in cells} == {("behaviour", "none"), ("proximal", "tis_token"), ("proximal", "mis_token")}
    assert plan.config.set["determinism"] == "lockstep" and plan.config.set["replay.wal.keep_segments"] is True
    assert set(plan.num_steps.values()) == {12}


def test_the_record_once_sweep_trains_from_a_lag_study_run():
    study, record_once = plan_sweep(STUDY, full=False), read_sweep(RECORD_ONCE)
    source = Path(record_once.set["replay.source.recorded"])
    assert source.parent == Path(study.config.run_dir) / study.config.name
    recorded = {c.name: c.overrides for c in study.cells}[source.name]
    assert recorded["lockstep_lag"] == 4  # the most off-policy data of the study
    shared = ("learner.num_steps", "learner.groups_per_step", "learner.engine.lr", "task.heldout_size")
    assert {k: record_once.set[k] for k in shared} == {k: study.config.set[k] for k in shared}
    corrections = list(zip(*study.config.zip.values()))  # the recorded run is the behaviour/none arm
    assert list(zip(*record_once.zip.values())) == [c for c in corrections if c != ("behaviour", "none")]


def _fake_run(root: Path, name: str, lag: int, is_weight: str, seed: int, accs: list[float]) -> None:
    run = root / name
    run.mkdir(parents=True)
    recipe = {"determinism": "lockstep", "lockstep_lag": lag, "seed": seed, "replay": {"source": None},
              "learner": {"algorithm": {"policy_ratio": "proximal", "is_weight": is_weight}}}
    (run / "recipe.json").write_text(json.dumps(recipe))
    rows = [{"step": -1, "eval": "before", "heldout_accuracy": accs[0]}]
    rows += [{"step": s, "loss": 0.1, "reward_mean": 0.25 * s, "is_ess_frac": 0.9, "ppo_clip_frac": 0.0,
              "tis_clip_frac": 0.01, "mis_masked_frac": 0.0, "step_s": 10.0} for s in (1, 2)]
    rows += [{"step": 2, "eval": "after", "heldout_accuracy": accs[1]}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text("{}")


def test_the_study_table_has_one_row_per_finished_run_and_draws_the_plot(tmp_path):
    spec = importlib.util.spec_from_file_location("study_table", "examples/experiments/study_table.py")
    study_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study_table)
    _fake_run(tmp_path / "sweep", "b", 2, "tis_token", 1, [0.125, 0.5])
    _fake_run(tmp_path / "sweep", "a", 0, "mis_token", 0, [0.125, 0.25])
    (tmp_path / "sweep" / "unfinished").mkdir()  # no summary.json: left out
    study_table.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "out")])
    lines = (tmp_path / "out" / "runs.md").read_text().splitlines()
    assert lines[0].startswith("| run | lag | correction | seed | data | acc@0 | acc@2 | reward")
    assert [line.split(" | ")[:4] for line in lines[2:]] == [["| a", "0", "proximal/mis_token", "0"],
                                                             ["| b", "2", "proximal/tis_token", "1"]]
    assert "| 0.125 | 0.500 | 0.375 | 0.900 |" in lines[3] and lines[3].endswith("| 20 |")
    assert (tmp_path / "out" / "final_vs_lag.png").stat().st_size > 1000
