"""The operator's side of a run: requests the supervisor takes, the status text, report plots, and the
error when no run is there. Plain Python (``FleetRequests`` is the body of the ``ControllerState`` actor)."""

import json
import time

import pytest

from gyre.services.cli import main as cli
from gyre.services.control.commands import ops
from gyre.services.control.commands import ray_connection
from gyre.services.control.commands.ops import FleetRequests, OpsError
from gyre.services.control.outputs.report import REPORT_PANELS, plot_report


def test_scale_restart_checkpoint_requests_are_taken_once():
    state = FleetRequests("r", "gyre", rollouts=1)
    assert state.take_requests() == {"rollouts": 1, "restart": [], "checkpoint": False, "reward_swaps": []}
    assert state.request_scale("rollout", 3) == 1
    state.request_restart("learner")
    state.request_checkpoint()
    swap = {"basic_arithmetic": [{"name": "math_exact"}]}
    assert state.request_reward_swap(swap) == 1
    assert state.take_requests() == {"rollouts": 3, "restart": ["learner"], "checkpoint": True,
                                     "reward_swaps": [{"id": 1, "swap": swap}]}
    # restart, checkpoint and swaps are one-shot; the desired fleet size persists
    assert state.take_requests() == {"rollouts": 3, "restart": [], "checkpoint": False, "reward_swaps": []}
    assert state.reward_swap_result(1) is None
    state.finish_reward_swap(1, {"ok": True})
    assert state.reward_swap_result(1) == {"ok": True}
    with pytest.raises(ValueError, match=r"reward swap \{'basic_arithmetic': \[\]\}: expected"):
        state.request_reward_swap({"basic_arithmetic": []})


@pytest.mark.parametrize("role, count, message", [
    ("learner", 2, "cannot scale 'learner': only 'rollout' scales"),
    ("rollout", 0, "rollout count must be an integer >= 1, got 0"),
    ("rollout", 2.5, "rollout count must be an integer >= 1, got 2.5"),
])
def test_bad_scale_requests_are_named(role, count, message):
    with pytest.raises(ValueError, match=message):
        FleetRequests("r", "gyre", 1).request_scale(role, count)


def _status() -> dict:
    return {"services": [
        {"name": "replay", "role": "replay", "pid": 11, "node": "10.0.0.1", "address": "10.0.0.1:5000",
         "metrics_port": 9101, "version": None, "restarts": 1, "failures": 0},
        {"name": "learner", "role": "learner", "pid": 12, "node": "10.0.0.1", "address": "10.0.0.1:5001",
         "version": 7, "restarts": 0, "failures": 0},
        {"name": "rollout-0", "role": "rollout", "pid": 13, "node": "10.0.0.2", "address": None,
         "version": 6, "restarts": 2, "failures": 0}],
        "learner_version": 7, "rollout_versions": [6], "lag": 1, "rollout_tokens_per_s": 1234.4,
        "learner_tokens_per_s": 99.6, "replay_groups": 5, "checkpoint_age_s": 12.2,
        "last_checkpoint": "runs/r/checkpoints/global_step_7", "restarts": {"replay": 1, "learner": 0, "rollout-0": 2},
        "updated_at": time.time()}


def test_restart_of_an_unknown_service_is_refused_once_status_is_known():
    state = FleetRequests("r", "gyre", 1)
    state.publish(_status())
    with pytest.raises(ValueError, match="no service 'rollout-5' in run r; services: replay, learner, rollout-0"):
        state.request_restart("rollout-5")


def test_status_text_shows_services_versions_lag_and_restarts():
    state = FleetRequests("r", "ns1", 2)
    state.publish(_status())
    lines = ops.format_status(state.status()).splitlines()
    assert lines[0].startswith("run r (namespace ns1), status 0 s old")
    assert lines[2].split() == ["replay", "11", "10.0.0.1", "-", "1", "9101", "10.0.0.1:5000"]
    assert lines[4].split() == ["rollout-0", "13", "10.0.0.2", "6", "2", "-", "-"]
    assert lines[5] == "policy     learner v7, rollouts [6], lag 1 versions"
    assert lines[6] == "throughput generate 1234 tok/s, learn 100 tok/s"
    assert lines[8] == "checkpoint runs/r/checkpoints/global_step_7 (12 s old)"
    assert lines[9] == "rollouts   1 running, 2 desired"
    assert ops.format_status({}).startswith("status not published yet")
    two_ranks = ops.format_status({**state.status(), "learner_ranks": 2}).splitlines()
    assert two_ranks[5] == "policy     learner v7 (2 ranks), rollouts [6], lag 1 versions"
    assert len(lines) == 10  # a status without "logs" (an older controller's) has no logs line
    with_logs = ops.format_status({**state.status(), "logs": "runs/r/logs"}).splitlines()
    assert with_logs[10] == "logs       runs/r/logs/<service>.log"


def test_recorded_ray_address_is_used_unless_one_is_given(tmp_path):
    assert ray_connection.connection_for("r", tmp_path) == ops.RayConnection("auto")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "ray_address").write_text("10.0.0.1:6379\n")  # a run from before ray_connection.json
    assert ray_connection.connection_for("r", tmp_path) == ops.RayConnection("10.0.0.1:6379")
    assert ray_connection.connection_for("r", tmp_path, "10.9.9.9:6379") == ops.RayConnection("10.9.9.9:6379")


def test_ops_command_without_a_cluster_says_no_run_is_running(capsys, monkeypatch):
    def no_cluster(**kwargs):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # set: the ops commands leave Ray's auth settings alone
    monkeypatch.setattr(ops.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ops.ray, "init", no_cluster)
    with pytest.raises(OpsError, match="no running gyre run named r in namespace ns: no Ray cluster at auto"):
        ops.connect("r", "ns", ops.RayConnection("auto"))
    code = cli.main(["status", "ghost", "--namespace", "ns", "--run-dir", "/nonexistent"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 2 and "no running gyre run named ghost in namespace ns" in out


def test_report_writes_one_png_per_panel(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    rows = [{"step": 0, "heldout_accuracy": 0.25}] + [
        {"step": s, "reward_mean": s / 10, "staleness_mean": 0.5, "staleness_max": 1, "tokens_per_s": 100.0,
         "rollout_tokens_per_s": 300.0} for s in range(1, 6)] + [{"step": 5, "heldout_accuracy": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["report", "r", "--run-dir", str(tmp_path)]) == 0
    for stem in REPORT_PANELS:
        png = run / "report" / f"{stem}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(FileNotFoundError, match="no metrics file at"):
        plot_report(tmp_path / "missing" / "metrics.jsonl", tmp_path / "out")
    (run / "metrics.jsonl").write_text('{"loss": 1}\n')
    with pytest.raises(ValueError, match="has no rows with a 'step' to plot"):
        plot_report(run / "metrics.jsonl", tmp_path / "out")
