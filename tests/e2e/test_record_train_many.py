"""One recorded tiny run, two claims (tiny random Llama; DeepSpeed, gRPC, a local Ray; the
rollout on the simulated engine of ``tests.engines``: recording, tracking and replaying are tested, not vLLM). A whole run costs
~100 s to start on the 2-core machine, so the run that is recorded is also the run that is tracked.

**Experiment tracking**: the 2-step recorded run has TensorBoard, MLflow (local file store) and W&B (offline) on;
each store is read back with its library's reader (tests/tracking_stores.py) and must hold the per-step ``loss`` and
``reward_mean`` of ``metrics.jsonl``, the final evaluation, its completions table, the recipe and the summary. W&B
runs offline (tests/conftest.py sets ``WANDB_MODE=offline``; the recipe asks for it too).

**Record once, train many** (``replay.source: {recorded: RUN_DIR}``): two learners with different importance
corrections (``learner.algorithm.is_weight``: ``tis_token`` and ``none``) train from the recorded run.
What must hold: both learners consumed the recorded learner's trajectories — the same ids in the same order, with
the same rows (tokens, behaviour logprobs, rewards) — read from each run's own replay WAL and, independently, from
each learner's journal; nothing was generated for training (replay stored only the copy), although the first run's
rollout evaluated the final policy; the second, asked for 5 steps, stopped when the recording ran out (2 steps);
the recording's replay directory is byte for byte what it was; and the setting really applied: the learner with the
recorded run's own correction (``tis_token``) ends with the recorded learner's parameters bit for bit, the other
one (``none``) with other parameters.
"""

import json

import pytest
from safetensors.torch import load_file

from gyre.proto.journal import read_journal
from gyre.replay.recorded import read_recording, sha256_files
from gyre.services.cli.invariants import check_run
from gyre.services.control.orchestration import controller
from gyre.services.control.recipe.schema import load_recipe
from tests.engines import sim_engine
from gyre.services.control.recipe.recorded import recorded_replay
from gyre.services.control.outputs.report import read_metrics
from tests.tracking_stores import mlflow_history, mlflow_run, tensorboard_scalars, tensorboard_texts, wandb_offline_runs
from tests.training import assert_trained

pytestmark = pytest.mark.slow

STEPS = 2
GROUPS_PER_STEP = 2
GROUP_SIZE = 2  # tiny-test's rollout.group_size
TRACKING = {"wandb": {"mode": "offline", "project": "gyre-e2e"}, "mlflow": {"experiment": "gyre-e2e"},
            "completions_per_eval": 4}


def _run(tiny_llama, runs, name, overrides):
    recipe = load_recipe("deploy/recipes/tiny-test.yaml", {
        "model": str(tiny_llama), "run_dir": str(runs), "name": name, "ray.num_cpus": 2, "eval_before": False,
        "eval_after": False, "learner.num_steps": STEPS, "learner.groups_per_step": GROUPS_PER_STEP,
        "replay.wal.keep_segments": True, **sim_engine(), **overrides})
    return controller.run(recipe), runs / name


@pytest.fixture(scope="module")
def recorded(tiny_llama, tmp_path_factory):
    """The recorded run, tracked: ``(summary, run directory, sha256 of its replay files right after it)``."""
    runs = tmp_path_factory.mktemp("runs")
    summary, out = _run(tiny_llama, runs, "recorded", {"eval_after": True, "eval.n_samples": 0, "tracking": TRACKING})
    return summary, out, sha256_files(out / "replay")


def _journal_groups(out) -> list[str]:
    """Group ids of the learner's committed checkpoints, in journal order (``learner.run_journal``)."""
    return [g for e in read_journal(out / "learner_journal.jsonl").events if e["event"] == "commit" for g in e["groups"]]


def _params(out) -> dict:
    return load_file(str(next((out / "final_policy").glob("*.safetensors"))))


def test_tensorboard_mlflow_and_wandb_offline_hold_the_metrics_of_a_tiny_run(recorded):
    summary, out, _ = recorded
    rows = read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    (final_eval,) = [r for r in rows if r.get("eval") == "after"]
    assert [r["step"] for r in train] == [1, 2] and summary["final_version"] == STEPS
    expected = {key: [(r["step"], r[key]) for r in train] for key in ("loss", "reward_mean")}
    ids = json.loads((out / "tracking.json").read_text())
    assert set(ids) == {"wandb", "mlflow"}

    # TensorBoard (float32 scalars), with each row's wall time
    scalars = tensorboard_scalars(out / "tb")
    for key, points in expected.items():
        assert [(s, pytest.approx(v, rel=1e-6)) for s, v in points] == [(s, v) for s, v, _ in scalars[key]], key
    assert [t for _, _, t in scalars["loss"]] == [pytest.approx(r["time"], abs=1e-3) for r in train]
    assert [(s, v) for s, v, _ in scalars["heldout_accuracy"]] == [(STEPS, pytest.approx(final_eval["heldout_accuracy"]))]
    texts = tensorboard_texts(out / "tb")
    assert texts["eval/completions"][0][0] == STEPS and len(texts["eval/completions"][0][1].splitlines()) == 2 + 4
    assert f"| final_version | {STEPS} |" in texts["summary"][0][1]

    # MLflow's file store under the run
    uri = (out / "mlruns").as_uri()
    for key, points in expected.items():
        assert [(s, v) for s, v, _ in mlflow_history(uri, ids["mlflow"], key)] == points, key
    run, client = mlflow_run(uri, ids["mlflow"])
    assert run.info.status == "FINISHED" and run.data.params["learner.num_steps"] == str(STEPS)
    assert [a.path for a in client.list_artifacts(ids["mlflow"], "eval")] == [f"eval/completions_step_{STEPS}.json"]

    # W&B's offline run folder under the run
    (wb,) = wandb_offline_runs(out)
    assert wb.run_id == ids["wandb"] and wb.project == "gyre-e2e" and wb.config["learner.num_steps"] == STEPS
    history = [h for h in wb.history if "loss" in h]
    for key, points in expected.items():
        assert [(h["learner_step"], h[key]) for h in history] == points, key
    assert [h["learner_step"] for h in wb.history if "eval/completions/_type" in h] == [STEPS]
    assert wb.summary["final_version"] == STEPS and wb.exit_code == 0


def test_two_learners_train_on_the_same_recorded_trajectories(recorded, tiny_llama):
    _, recorded_dir, before = recorded
    runs = recorded_dir.parent
    recording = read_recording(recorded_replay(recorded_dir))
    assert len(recording.group_ids) == STEPS * GROUPS_PER_STEP  # what the recorded learner consumed
    assert recording.group_ids == _journal_groups(recorded_dir)

    trained = {}
    for name, is_weight, extra in (("tis", "tis_token", {"eval_after": True}),
                                   ("plain", "none", {"learner.num_steps": 5})):
        summary, out = _run(tiny_llama, runs, name, {"replay.source": {"recorded": str(recorded_dir)},
                                                     "learner.algorithm.is_weight": is_weight, **extra})
        assert summary["final_version"] == STEPS  # "plain" asked for 5: the recording holds 2 steps' groups
        consumed = read_recording(recorded_replay(out))  # this run's own replay WAL: what its learner consumed
        assert consumed.trajectory_ids == recording.trajectory_ids
        assert all(a.equals(b) for a, b in zip(consumed.groups, recording.groups))  # the recorded rows, unchanged
        assert _journal_groups(out) == recording.group_ids  # the learner's own account, in the same order
        assert summary["replay"]["inserted_total"] == len(recording.group_ids) * GROUP_SIZE  # only the copy
        report = check_run(out)
        assert report.ok and report.counts["trained_groups"] == STEPS * GROUPS_PER_STEP, report.to_json()
        assert_trained(out, tiny_llama, min_fraction=1.0)
        trained[name] = (summary, _params(out))

    tis, plain = trained["tis"], trained["plain"]
    assert 0 <= tis[0]["heldout_accuracy_after"] <= 1  # evaluated as usual, by a rollout that generated nothing
    assert (runs / "tis" / "eval" / f"step_{STEPS}.jsonl").is_file()
    (stats,) = tis[0]["rollout_stats"]
    assert stats["groups"] == 0 and stats["version"] == STEPS  # it followed the learner's weights, generated nothing
    assert plain[0]["rollout_stats"] == []  # no evaluation asked: no rollout started
    # tis_token is the recorded run's own setting: on the same groups in the same order that learner ends with the
    # recorded learner's parameters bit for bit (the copy is faithful), while is_weight none ends elsewhere
    recorded = _params(recorded_dir)
    assert [n for n in recorded if not recorded[n].equal(tis[1][n])] == []
    differing = [n for n in tis[1] if not tis[1][n].equal(plain[1][n])]
    assert len(differing) * 2 > len(tis[1]), f"only {differing} differ between is_weight tis_token and none"
    assert sha256_files(recorded_dir / "replay") == before  # the recording was only read
