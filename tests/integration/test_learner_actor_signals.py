"""The learner actor on a local Ray: SIGUSR1 checkpoints and keeps serving; SIGTERM checkpoints and the
process exits (through Ray's own SIGTERM path). Real DeepSpeed on the tiny Llama, a real replay actor."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from gyre.learner.checkpoint import store as ckpt


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.2)


@pytest.mark.slow
def test_sigusr1_checkpoints_and_sigterm_checkpoints_then_exits(tiny_llama, tmp_path):
    from gyre.services.control.orchestration.controller import actor_env, init_ray
    from gyre.services.learner.actor import LearnerActor
    from gyre.services.replay.actor import ReplayActor

    init_ray("local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=128 * 1024**2)
    try:
        opts = {"num_cpus": 0, "runtime_env": {"env_vars": actor_env()}}
        replay = ReplayActor.options(**opts).remote({}, dir=str(tmp_path / "replay"))
        config = {"engine": {"model": str(tiny_llama), "micro_batch_size": 2}, "num_steps": 1}
        address = ray.get(replay.address.remote())
        learners = [LearnerActor.options(max_concurrency=4, **opts).remote(
            config, address, checkpoint_dir=str(tmp_path / name)) for name in ("usr1", "term")]
        usr1, term = (ray.get(a.describe.remote()).pid for a in learners)

        os.kill(usr1, signal.SIGUSR1)
        _wait(lambda: ckpt.find_latest_verified(tmp_path / "usr1") is not None, 120, "a SIGUSR1 checkpoint")
        assert ray.get(learners[0].describe.remote()).pid == usr1  # still serving
        assert ckpt.verify(tmp_path / "usr1" / "global_step_0").step == 0

        assert ckpt.find_latest_verified(tmp_path / "term") is None
        os.kill(term, signal.SIGTERM)
        _wait(lambda: not _alive(term), 120, "the learner process to exit after SIGTERM")
        assert ckpt.find_latest_verified(tmp_path / "term") == tmp_path / "term" / "global_step_0"
    finally:
        ray.shutdown()
