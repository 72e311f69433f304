"""The study's sweep files (``examples/experiments``, docs/experiments/lag-study.md): every cell's recipe loads, the
cells are the study's 3 lags × 3 corrections × 2 seeds, and the record-once sweep trains the other two corrections
on one of its runs' recording."""

from __future__ import annotations

from pathlib import Path

from services.cli.sweep import plan_sweep
from services.cli.sweep_config import read_sweep

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
