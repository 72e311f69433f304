"""Crash matrix: every fault point in ``faults.POINTS`` fires in a whole tiny-model run under the controller
(DeepSpeed, gRPC, a local Ray; the rollout on the simulated engine, ``tests.engines``: supervision and durability
are what is tested, and a restarted rollout starts in a second instead of vLLM's ~20 s), and the run still trains
every step.

One run arms a list of fault specs per service (the recipe's ``faults`` section, one spec per incarnation), so a
service is SIGKILLed at a named phase, restarted by the supervisor, killed again at the next phase, and so on;
the last incarnation runs clean. After the run: every step was trained, with gradients, and the final policy is
not the initial model; the fire log (``faults.read_fire_log``: each point appends a line and fsyncs it before it
kills) lists exactly the armed (service, incarnation, point) triples — a restart for any other reason (a hung
service the health check gave up on) leaves no line —, each service was restarted exactly that many times; and
the supervisor's death list (``summary["deaths"]``: service, incarnation ended) equals the fire log's (service,
incarnation) pairs; and the invariant checker (``services.cli.invariants.check_run``) finds no violation, no lost group, no group trained
twice, and ``steps × groups_per_step`` groups trained.

Knobs that make every point reachable in a short run: replay WAL segments of 4 KiB (``after_roll``) and a
snapshot every 2 s (``replay.snapshot.*``); the learner checkpoints every step in the background
(``learner.ckpt.*``, ``mid_write`` needs ``async_save``), mirrors (``learner.mirror_dir``) and archives to a
``file://`` URL (``learner.archive``); the rollout spools every group (``rollout.spool_dir``).

Hit counts (``#n``) keep a fault out of the supervisor's restart window (a restarted incarnation that dies
before the supervisor's ``describe`` answered would fail the run): a restarted replay writes a few WAL records
and one snapshot as soon as clients reconnect, a restarted rollout flushes what its predecessor spooled.

The learner's faults get a run of their own: a restarted learner acks its checkpoint's leases to replay inside
its constructor, which ``Supervisor.restart`` waits for, so a replay that dies meanwhile is not restarted until
that ack went through — it never does. Replay and rollout restarts do not wait on each other and share one run.

Each run prints one JSON line (and writes ``{run_dir}/crash_matrix.json``) for the table in docs/durability/crash-testing.md.
"""

import json
import time

import pytest

from gyre import faults
from gyre.services.cli.invariants import check_run
from gyre.services.control.orchestration import controller
from gyre.services.control.orchestration.factory import FIRE_LOG
from gyre.services.control.recipe.schema import load_recipe
from tests.engines import TINY_GROUP_S, sim_engine
from tests.training import assert_trained

pytestmark = pytest.mark.slow

RUNS = {
    "replay-rollout": {
        "steps": 24,
        "faults": {
            "replay": ["replay.wal.before_write#10", "replay.wal.after_append#10", "replay.wal.before_fsync#10",
                       "replay.wal.after_roll#2", "replay.snapshot.files_written#2",
                       "replay.snapshot.before_rename#2", "replay.snapshot.after_rename#2",
                       "replay.snapshot.before_wal_delete#2"],
            # apply_weights only in the first incarnation: a restarted one applies the newest version during
            # its setup, inside the supervisor's restart
            "rollout-0": ["rollout.apply_weights", "rollout.spool.before_rename#2", "rollout.spool.after_rename#2",
                          "rollout.spool.flush#3"],
        },
    },
    "learner": {
        "steps": 8,
        "faults": {
            # incarnations 1-4 die after their checkpoint committed (training moves on), 5-9 before
            "learner": ["learner.ckpt.after_rename", "learner.mirror.before_manifest", "learner.mirror.before_rename",
                        "learner.archive.before_manifest", "learner.ckpt.mid_write", "learner.ckpt.files_written",
                        "learner.ckpt.before_manifest", "learner.ckpt.before_rename", "learner.publish.mid_stream"],
        },
    },
}
"""Run name → learner steps and the recipe's ``faults`` section (one spec per incarnation). ``steps`` leaves a
margin: the supervisor restarts one service at a time, so replay's last incarnations die while the final steps
train — a fault that fires only during shutdown is not restarted and fails the restart count."""


def armed_points(section: dict[str, list[str]]) -> set[str]:
    return {p for specs in section.values() for spec in specs for p in faults.parse_spec(spec)}


def armed_fires(section: dict[str, list[str]]) -> list[tuple[str, int, str]]:
    """(service, incarnation, point) of every armed incarnation, sorted (each spec arms one point)."""
    return sorted((svc, i, p) for svc, specs in section.items() for i, spec in enumerate(specs)
                  for p in faults.parse_spec(spec))


def fires(run_dir) -> list[tuple[str, int, str]]:
    """(service, incarnation, point) of every line of the run's fire log, sorted."""
    return sorted((r["service"], r["incarnation"], r["point"]) for r in faults.read_fire_log(run_dir / FIRE_LOG))


def test_the_matrix_covers_every_fault_point():
    from tests.fault.test_reward_model_crash import FAULTS as REWARD_MODEL_FAULTS  # its own run (a reward model)

    covered = set().union(*(armed_points(run["faults"]) for run in RUNS.values()), armed_points(REWARD_MODEL_FAULTS))
    assert covered == set(faults.POINTS), sorted(set(faults.POINTS) ^ covered)


def matrix_recipe(name: str, run: dict, tiny_llama, tmp_path):
    out = tmp_path / name
    return load_recipe("deploy/recipes/tiny-test.yaml", {
        "model": str(tiny_llama), "run_dir": str(tmp_path), "ray.num_cpus": 2, "name": name,
        "eval_before": False, "eval_after": False, "faults": run["faults"],
        "learner.num_steps": run["steps"], "learner.save_interval": 1, "learner.async_save": True,
        "learner.mirror_dir": str(out / "mirror"), "learner.archive": {"url": f"file://{out / 'archive'}"},
        # leases outlive the rollout restarts (25-90 s on two loaded cores) that starve the learner between two
        # checkpoints (with async_save a checkpoint's leases are acked when the next checkpoint begins)
        "replay.lease_ttl_s": 600, "replay.prompt_lease_ttl_s": 20,
        "replay.wal": {"segment_bytes": 4096}, "replay.snapshot": {"interval_s": 2.0},
        "rollout.spool_dir": str(out / "spool"), **sim_engine(TINY_GROUP_S)})


def test_crash_matrix_learner(tiny_llama, tmp_path):
    check_matrix_run("learner", tiny_llama, tmp_path)


def check_matrix_run(name: str, tiny_llama, tmp_path) -> None:
    """Run ``RUNS[name]`` under the controller and check what must hold (the replay-rollout run is in
    ``test_crash_matrix_replay_rollout.py``, so that ``make test``'s two workers can run both at once)."""
    run = RUNS[name]
    recipe = matrix_recipe(name, run, tiny_llama, tmp_path)
    t0 = time.monotonic()
    summary = controller.run(recipe)
    seconds = time.monotonic() - t0

    out = recipe.out_dir
    fired, report = fires(out), check_run(out)
    info = summary["replay"]
    row = {"run": name, "points_fired": sorted({p for _, _, p in fired}), "restarts": summary["restarts"],
           "steps": summary["final_version"], "groups_acked": info["acked_groups_total"],
           "trajectories_acked": info["acked_groups_total"] * recipe.rollout.group_size,
           "wall_s": round(seconds, 1), "lost_groups": report.counts.get("lost_groups"),
           "duplicates_trained": report.counts.get("duplicates_trained"),
           "trained_groups": report.counts.get("trained_groups"), "invariants_ok": report.ok}
    (out / "crash_matrix.json").write_text(json.dumps(row, indent=2))
    print(json.dumps(row))

    assert summary["final_version"] == run["steps"]
    rows = assert_trained(out, tiny_llama)
    assert rows[-1]["step"] == run["steps"]
    # every armed incarnation died at its own point (the fire log proves it); the supervisor handled exactly
    # those deaths, each with the incarnation it ended (nothing else restarted); one restart per death
    assert fired == armed_fires(run["faults"])
    assert sorted((d["service"], d["incarnation"]) for d in summary["deaths"]) == [(s, i) for s, i, _ in fired]
    restarts = {svc: sum(1 for s in specs if s) for svc, specs in run["faults"].items()}
    assert summary["restarts"] == {"replay": 0, "learner": 0, "rollout-0": 0, **restarts}
    assert info["acked_groups_total"] == run["steps"] * recipe.learner.groups_per_step
    assert report.ok, report.to_json()
    assert report.counts["lost_groups"] == 0
    assert report.counts["duplicates_trained"] == 0
    assert report.counts["trained_groups"] == run["steps"] * recipe.learner.groups_per_step
