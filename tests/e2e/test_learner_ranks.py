"""A two-rank learner under the controller (tiny random Llama, DeepSpeed ZeRO-2 over gloo, gRPC,
a local Ray; the rollout on the simulated engine of ``tests.engines``): the ranks land in the learner's placement group, rank 1 follows rank 0's collective calls, and
SIGKILLing rank 1 mid-run restarts the whole learner group once (fail-stop), which resumes from its newest
checkpoint; the run finishes every step, every checkpoint was written by world size 2, and ``gyre check``
finds no lost or twice-trained group."""

import json
import os
import signal
import threading
import time

import pytest
import ray

from gyre.services.cli.invariants import check_run
from gyre.services.control.commands import ops
from gyre.services.control.orchestration.factory import actor_name
from gyre.services.control.recipe.schema import load_recipe
from tests.engines import TINY_GROUP_S, sim_engine
from tests.e2e.chaos_run import run_with_chaos
from tests.training import assert_trained

pytestmark = pytest.mark.slow

STEPS = 4


class KillRank1(threading.Thread):
    """Once the learner trained 2 steps, SIGKILL rank 1's process; record its pid and the restarts seen."""

    def __init__(self, run: str, namespace: str) -> None:
        super().__init__(daemon=True)
        self.run_name, self.namespace = run, namespace
        self.killed_pid = self.new_pid = None
        self.restarts_seen = None
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            state = self._actor("controller")
            self._wait(lambda: (ops.status(state) or {}).get("learner_version") or 0, 2)
            rank1 = self._actor("learner-rank-1")
            self.killed_pid = ray.get(rank1.describe.remote(), timeout=30).pid
            os.kill(self.killed_pid, signal.SIGKILL)
            self._wait(lambda: ops.status(state)["restarts"].get("learner", 0), 1)
            self.restarts_seen = dict(ops.status(state)["restarts"])
            self.new_pid = ray.get(self._actor("learner-rank-1").describe.remote(), timeout=60).pid
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def _actor(self, service: str):
        deadline = time.monotonic() + 300
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                if ray.is_initialized():
                    return ray.get_actor(actor_name(self.run_name, service), namespace=self.namespace)
            except ValueError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"actor {service} never appeared")

    def _wait(self, value, at_least: int, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            if value() >= at_least:
                return
            time.sleep(0.5)
        raise TimeoutError(f"waited {timeout_s} s for {at_least}")


@pytest.mark.parametrize("async_save", [False, True], ids=["sync-save", "async-save"])
def test_a_killed_rank_restarts_the_learner_group_and_the_run_finishes(tiny_llama, tmp_path, monkeypatch, async_save):
    recipe = load_recipe("deploy/recipes/tiny-test.yaml", {
        "model": str(tiny_llama), "run_dir": str(tmp_path), "ray.num_cpus": 2, "name": "ranks",
        "learner.num_steps": STEPS, "learner.save_interval": 1, "replay.lease_ttl_s": 60,
        "placement.learner.world_size": 2, "placement.learner.strategy": "PACK", "learner.async_save": async_save,
        "eval_before": False, "eval_after": False, **sim_engine(TINY_GROUP_S)})
    chaos = KillRank1(recipe.name, recipe.ray.namespace)
    summary = run_with_chaos(recipe, chaos, monkeypatch)

    assert chaos.error is None, repr(chaos.error)
    assert chaos.killed_pid is not None and chaos.new_pid not in (None, chaos.killed_pid)
    assert chaos.restarts_seen.get("learner") == 1
    assert summary["final_version"] == STEPS and summary["restarts"]["learner"] == 1
    out = tmp_path / "ranks"
    metas = [json.loads((p / "metadata.json").read_text()) for p in (out / "checkpoints").glob("global_step_*")]
    assert metas and {m["world_size"] for m in metas} == {2}
    assert sorted((out / "checkpoints" / f"global_step_{STEPS}" / "deepspeed").glob("*optim_states.pt")) \
        and len(list((out / "checkpoints" / f"global_step_{STEPS}" / "deepspeed").glob("*optim_states.pt"))) == 2
    assert_trained(out, tiny_llama)  # the two ranks' all-reduced gradients are not zero; the weights moved
    report = check_run(out)
    assert report.ok, report.to_json()
    assert report.counts["trained_groups"] == STEPS * recipe.learner.groups_per_step, report.to_json()
    assert report.counts["lost_groups"] == 0 and report.counts["duplicates_trained"] == 0
    assert report.counts["resumes"] == 2  # the cold start and the group restart
