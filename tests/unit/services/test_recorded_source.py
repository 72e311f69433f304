"""``replay.source: {recorded: RUN_DIR}`` (record once, train many): checked when the recipe loads, the run's replay
built from the recording at start (``services.control.recipe.recorded.use_recording``), rollouts for evaluation only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from gyre.learner.run_journal import LearnerJournal
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.replay.recorded import NO_STALENESS_GATE, read_manifest, sha256_files
from gyre.replay.wal_read import list_segments
from gyre.services.cli.invariants import RunDirError, check_run
from gyre.services.control.recipe.plan import describe
from gyre.services.control.recipe.schema import RecipeError, load_recipe
from gyre.services.control.recipe.recorded import RecordingError, rollouts_to_start, use_recording
from tests.fakes import group_table

TINY = "deploy/recipes/tiny-test.yaml"


def recorded_run(run_dir, consumed: int = 5):
    """A finished run's directory: recipe.json (its replay section) and replay/, whose learner acked ``consumed``
    single-group leases of prompts 0, 1, ... (one more group stays pooled)."""
    cfg = ReplayConfig(max_staleness=1, snapshot={"interval_s": None, "wal_bytes": None})
    run_dir.mkdir(parents=True)
    (run_dir / "recipe.json").write_text(json.dumps({"name": run_dir.name, "replay": cfg.model_dump(mode="json")}))
    buf = TrajectoryBuffer(cfg.model_copy(update={"dir": str(run_dir / "replay")}))
    for prompt in range(consumed + 1):
        buf.insert(group_table(prompt))
    for _ in range(consumed):
        lease, _ = buf.sample(1, learner_version=0, consumer="learner")
        buf.ack([lease])
    buf.close()
    return run_dir


def recipe(tmp_path, source, **overrides):
    return load_recipe(TINY, {"run_dir": str(tmp_path / "runs"), "eval.before": False, "eval.after": False,
                              "replay.source": {"recorded": str(source)}, **overrides}, dry_run=True)


@pytest.mark.parametrize("settings, message", [
    ({"selector": "uniform"}, "replay.selector ('uniform') must be 'fifo' with replay.source"),
    ({"max_times_sampled": 2}, "replay.max_times_sampled (2) must be 1 with replay.source"),
    ({"rate_limiter": {"min_size_to_sample": 4}}, "replay.rate_limiter ({'min_size_to_sample': 4}) must be left at"),
])
def test_settings_that_would_change_what_is_consumed_are_refused(tmp_path, settings, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        ReplayConfig(source={"recorded": str(tmp_path)}, **settings)
    ReplayConfig(**settings)  # fine without a source


def test_the_recorded_path_is_made_absolute_and_must_not_be_empty(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ReplayConfig(source={"recorded": "runs/rec"}).source.recorded == str(tmp_path / "runs" / "rec")
    with pytest.raises(ValidationError, match="expected the directory of a recorded run"):
        ReplayConfig(source={"recorded": " "})


def test_a_missing_incomplete_or_corrupt_recording_is_refused_when_the_recipe_loads(tmp_path):
    with pytest.raises(RecipeError, match=f"replay.source: {tmp_path / 'nope'} is not a recorded run's directory"):
        recipe(tmp_path, tmp_path / "nope")
    run = tmp_path / "rec"
    run.mkdir()
    (run / "recipe.json").write_text("{}")
    with pytest.raises(RecipeError, match=f"replay directory {run / 'replay'} does not exist"):
        recipe(tmp_path, run)
    good = recorded_run(tmp_path / "good")
    segment = list_segments(good / "replay" / "wal")[0]
    data = bytearray(segment.read_bytes())
    data[len(data) // 3] ^= 0xFF
    segment.write_bytes(bytes(data))
    with pytest.raises(RecipeError, match=f"replay.source: corrupt recording: WAL segment {segment}"):
        recipe(tmp_path, good)


def test_lockstep_and_the_runs_own_directory_are_refused(tmp_path):
    rec = recorded_run(tmp_path / "runs" / "tiny-test")
    with pytest.raises(RecipeError, match="is this run's own directory"):
        recipe(tmp_path, rec)
    other = recorded_run(tmp_path / "other")
    with pytest.raises(RecipeError, match="determinism: lockstep cannot train from a recording"):
        recipe(tmp_path, other, determinism="lockstep", **{"replay.max_staleness": 1})
    with pytest.raises(RecipeError, match="is the recording's own"):
        recipe(tmp_path, other, **{"replay.dir": str(other / "replay")})


def test_the_run_gets_a_copy_and_stops_when_the_recording_is_used_up(tmp_path):
    rec = recorded_run(tmp_path / "rec", consumed=5)
    before = sha256_files(rec)
    r = recipe(tmp_path, rec, **{"learner.num_steps": 10, "learner.groups_per_step": 2})
    assert "a copy of the recording" in describe(r) and "rollout×0" in describe(r)
    used = use_recording(r)
    dest = r.out_dir / "replay"
    assert read_manifest(dest)["groups"] == [f"{p}-0" for p in range(5)]
    assert used.learner.num_steps == 2  # 5 groups: two steps of 2; the fifth is never a whole batch
    assert used.replay.max_staleness == NO_STALENESS_GATE and used.replay.source == r.replay.source
    assert sha256_files(rec) == before
    built = sha256_files(dest)
    again = use_recording(r)  # a resumed run re-uses its copy as it is
    assert again.learner.num_steps == 2 and sha256_files(dest) == built
    other = recorded_run(tmp_path / "other")
    with pytest.raises(RecordingError, match=f"holds a copy of the recording {rec}, not {other}"):
        use_recording(recipe(tmp_path, other))


def test_a_replay_not_built_from_a_recording_and_a_too_short_recording_are_refused(tmp_path):
    rec = recorded_run(tmp_path / "rec", consumed=1)
    r = recipe(tmp_path, rec, **{"learner.groups_per_step": 2})
    with pytest.raises(RecordingError, match=r"holds 1 consumed groups, fewer than learner.groups_per_step \(2\)"):
        use_recording(r)
    assert not (r.out_dir / "replay").exists()  # refused before anything was built
    ordinary = recipe(tmp_path, recorded_run(tmp_path / "rec2"), name="ordinary")
    (ordinary.out_dir / "replay" / "wal").mkdir(parents=True)
    with pytest.raises(RecordingError, match="holds a replay that was not built from a recording"):
        use_recording(ordinary)


def test_rollouts_run_only_to_evaluate(tmp_path):
    rec = recorded_run(tmp_path / "rec")
    assert rollouts_to_start(recipe(tmp_path, rec)) == 0
    assert rollouts_to_start(recipe(tmp_path, rec, **{"eval.after": True, "rollout.num_workers": 3})) == 1
    assert rollouts_to_start(recipe(tmp_path, rec, **{"eval.every_steps": 2})) == 1
    plain = load_recipe(TINY, {"run_dir": str(tmp_path / "runs"), "rollout.num_workers": 3}, dry_run=True)
    assert rollouts_to_start(plain) == 3 and use_recording(plain) is plain


def test_gyre_check_takes_a_run_that_trained_from_a_recording_without_rollouts(tmp_path):
    r = recipe(tmp_path, recorded_run(tmp_path / "rec"), **{"learner.groups_per_step": 2})
    used = use_recording(r)
    out = r.out_dir
    (out / "recipe.json").write_text(used.model_dump_json())  # as the controller writes it
    buf = TrajectoryBuffer(used.replay.model_copy(update={"dir": str(out / "replay")}))
    lease, table = buf.sample(2, learner_version=7, consumer="learner")
    groups = sorted(set(table.column("group_id").to_pylist()))
    journal = LearnerJournal(out / "learner_journal.jsonl")
    journal.save_begin(1, 1, groups)
    journal.commit(Path("global_step_1"), groups)
    buf.ack([lease])
    buf.close()
    report = check_run(out)
    assert report.ok and report.counts["trained_groups"] == 2 and report.counts["in_replay_groups"] == 3, \
        report.to_json()
    plain = json.loads((out / "recipe.json").read_text())
    plain["replay"]["source"] = None
    (out / "recipe.json").write_text(json.dumps(plain))
    with pytest.raises(RunDirError, match="no rollout journal"):  # a usual run without one is still refused
        check_run(out)
