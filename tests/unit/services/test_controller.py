import io
import json
import os

import pytest

from rich.console import Console

from gyre.learner.checkpoint.store import fingerprint_diff
from gyre.services.control.orchestration.controller import archive_previous_run, prepare_run_dir, task_fingerprint
from gyre.services.control.recipe.schema import load_recipe
from tests.tiny_model import SMOLLM2_DIR


def test_previous_run_is_moved_aside_not_reused(tmp_path):
    out = tmp_path / "runs" / "r"
    assert archive_previous_run(out) is None
    (out / "replay").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    moved = archive_previous_run(out)
    assert not out.exists() and (moved / "metrics.jsonl").read_text() == "{}\n"
    assert moved.name.startswith("r.")


def test_task_fingerprint_changes_with_the_task():
    base = {"model": str(SMOLLM2_DIR)}
    a = task_fingerprint(load_recipe("deploy/recipes/tiny-test.yaml", base))
    b = task_fingerprint(load_recipe("deploy/recipes/tiny-test.yaml", base | {"task.heldout_size": 9}))
    assert json.loads(a)["task"]["name"] == "basic_arithmetic" and a != b
    assert a == task_fingerprint(load_recipe("deploy/recipes/tiny-test.yaml", base))
    assert fingerprint_diff(a, b) == "task.heldout_size: checkpoint 8 != current 9"


def _recipe(tmp_path, resume="auto", steps=3):
    return load_recipe("deploy/recipes/tiny-test.yaml", {"model": str(SMOLLM2_DIR), "run_dir": str(tmp_path),
                                                         "learner.resume": resume, "learner.num_steps": steps})


def test_resume_auto_reuses_the_run_dir_and_a_finished_run_says_so(tmp_path):
    console = Console(file=io.StringIO(), width=200)
    out = tmp_path / "tiny-test"
    assert prepare_run_dir(_recipe(tmp_path), console) is None and out.is_dir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert prepare_run_dir(_recipe(tmp_path), console) is None
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # re-used, not moved aside
    (out / "summary.json").write_text(json.dumps({"final_version": 3}))
    done = prepare_run_dir(_recipe(tmp_path), console)
    assert done == {"final_version": 3, "already_finished": True}
    assert "run tiny-test already finished (policy version 3)" in console.file.getvalue()
    assert prepare_run_dir(_recipe(tmp_path, steps=5), console) is None  # more steps asked: continue it


def test_resume_none_archives_the_old_run_dir(tmp_path):
    console = Console(file=io.StringIO(), width=200)
    out = tmp_path / "tiny-test"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"final_version": 3}))
    assert prepare_run_dir(_recipe(tmp_path, resume="none"), console) is None
    assert out.is_dir() and not any(out.iterdir())
    archived = [p for p in tmp_path.iterdir() if p.name.startswith("tiny-test.")]
    assert len(archived) == 1 and (archived[0] / "summary.json").is_file()


def _fake_ray(monkeypatch, errors):
    from gyre.services.control.orchestration import controller

    calls = []

    def init(**kwargs):
        calls.append(("init", kwargs["address"]))
        if errors:
            raise errors.pop(0)
    monkeypatch.setattr(controller.ray, "init", init)
    monkeypatch.setattr(controller.ray, "shutdown", lambda: calls.append(("shutdown", None)))
    return controller.init_ray, calls


@pytest.mark.parametrize("error", [
    Exception("The current node timed out during startup. This could ..."),
    RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_771c329d")])
def test_a_local_ray_whose_raylet_or_gcs_missed_its_start_window_is_started_again(monkeypatch, error):
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "")  # so that teardown restores the original
    monkeypatch.delenv("RAY_gcs_server_port_wait_time_s")
    init_ray, calls = _fake_ray(monkeypatch, [error])
    init_ray("local", num_cpus=1)
    assert calls == [("init", "local"), ("shutdown", None), ("init", "local")]
    assert os.environ["RAY_gcs_server_port_wait_time_s"] == "120"  # Ray's own 30 s window, widened


def test_other_ray_start_errors_and_attaching_are_not_retried(monkeypatch):
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "30")  # what init_ray("local") sets stays in this test
    init_ray, calls = _fake_ray(monkeypatch, [ValueError("bad num_cpus")])
    with pytest.raises(ValueError, match="bad num_cpus"):
        init_ray("local")
    init_ray, calls = _fake_ray(monkeypatch, [Exception("The current node timed out during startup.")])
    with pytest.raises(Exception, match="timed out during startup"):
        init_ray("auto")
    assert calls == [("init", "auto")]
    init_ray, calls = _fake_ray(monkeypatch, [Exception("timed out during startup")] * 2)
    with pytest.raises(Exception, match="timed out during startup"):  # twice: the second error is raised
        init_ray("local")
    assert [c[0] for c in calls] == ["init", "shutdown", "init"]


def test_supervised_calls_again_after_the_service_died_at_most_attempts_times(monkeypatch):
    from ray.exceptions import RayActorError
    from structlog.testing import capture_logs

    from gyre.services.control.orchestration import controller

    monkeypatch.setattr(controller.ray, "get", lambda ref: ref)

    class Supervisor:
        ticks = 0

        def tick(self):
            self.ticks += 1

    def scripted(*outcomes):
        left = list(outcomes)

        def call():
            outcome = left.pop(0)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return call, left

    sup, (call, left) = Supervisor(), scripted(RayActorError(), RayActorError(), "summary")
    with capture_logs() as logs:
        assert controller._supervised(sup, call) == "summary"
    assert sup.ticks == 2 and left == [] and [e["event"] for e in logs] == ["service_died_after_training"] * 2
    sup, (call, left) = Supervisor(), scripted(RayActorError(), RayActorError(), RayActorError(), "never")
    with pytest.raises(RayActorError):  # the third death is raised
        controller._supervised(sup, call)
    assert sup.ticks == 2 and left == ["never"]
    sup, (call, left) = Supervisor(), scripted(ValueError("bad summary"), "never")
    with pytest.raises(ValueError, match="bad summary"):  # not a death: raised at once
        controller._supervised(sup, call)
    assert sup.ticks == 0 and left == ["never"]


def test_the_end_of_training_pauses_every_running_rollout_and_survives_a_dead_one(monkeypatch):
    """At the end of training one dead rollout (killed while its replacement starts) failed the whole run: the pauses
    were one ``ray.get`` (seen in ``bench.fleet``), then the stats likewise. Each is asked alone now; the dead one is
    named."""
    from types import SimpleNamespace

    from ray.exceptions import RayActorError

    from gyre.services.control.orchestration import controller

    paused = []

    def handle(name, dead=False):
        def pause():
            if dead:
                raise RayActorError()
            paused.append(name)
        return SimpleNamespace(pause=SimpleNamespace(remote=lambda: pause))

    svcs = [SimpleNamespace(name=n, handle=handle(n, dead=n == "rollout-1")) for n in ("rollout-0", "rollout-1", "rollout-2")]
    sup = SimpleNamespace(running_rollouts=lambda: svcs)
    monkeypatch.setattr(controller, "ray", SimpleNamespace(get=lambda ref, timeout=None: ref()))
    answers, failed = controller.ask_rollouts(sup, "pause")
    assert failed == ["rollout-1"] and list(answers) == ["rollout-0", "rollout-2"]
    assert paused == ["rollout-0", "rollout-2"]
