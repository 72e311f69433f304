"""Async checkpoint save with two learner ranks (``learner.checkpoint.async_save``): real DeepSpeed (ZeRO-2 and
ZeRO-3, where each rank also writes its own partition of the weights; fp32, CPU/gloo) in two spawned processes,
rank 0 a ``LeaderEngine`` and rank 1 ``follow``-ing it, as in the learner service.

The overlap is forced, not hoped for: each rank's background writer (``write_captured``, wrapped here) holds while
a file ``hold{rank}`` exists, and rank 0 removes them only after the next training step returned. So
``save_checkpoint`` must return (a ``Future``) before any shard is written, the next ``train_step`` (a collective:
rank 1 trains in it too) must complete while both writers are held, and only then does the save commit: rank 0
waits for rank 1's shard marker, not for a collective. The committed checkpoint holds both ranks' shards and
resumes exactly: loading it and replaying the step gives the same weights bit for bit. With the old synchronous
multi-rank save ``save_checkpoint`` returned a path after writing every file, and both tests here fail.

A save of the same step retried after rank 0's own write failed (a file ``fail0``) must wait for rank 1's new
shard, not take the marker rank 1 left for the failed attempt (checked by holding rank 1's second write: without
``clear_shard_mark`` rank 0 committed at once, with rank 1's files still being rewritten).
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path

import pytest

from tests.rendezvous import rank_store, run_spawned

pytestmark = pytest.mark.slow

HOLD_S = 2.0
"""How long the retry scenario lets rank 0's writer run while rank 1's is held (seconds); it commits at once when
it wrongly trusts a stale marker (a few ms here)."""


def _control_writers(folder: Path, rank: int, report: dict) -> None:
    """Wrap this process's background writer: refuse to write in the training thread (where a hold would deadlock:
    the training thread lifts it); a file ``folder/fail{rank}`` is consumed and the write fails with ENOSPC; while
    ``folder/hold{rank}`` exists, the write waits. ``report["writes"]`` records per write whether it was held."""
    import errno

    import gyre.learner.checkpoint.engine as ckpt_engine

    write_captured = ckpt_engine.write_captured
    report["writes"] = []

    def controlled(captured):
        if threading.current_thread() is threading.main_thread():
            raise AssertionError("the shard was written in the training thread (not async)")
        fail = folder / f"fail{rank}"
        if fail.exists():
            fail.unlink()
            report["writes"].append("failed")
            raise OSError(errno.ENOSPC, "No space left on device (test)")
        held, deadline = False, time.monotonic() + 300
        while (folder / f"hold{rank}").exists():
            assert time.monotonic() < deadline, f"rank {rank}'s writer was held for 300 s"
            held = True
            time.sleep(0.02)
        report["writes"].append("held" if held else "written")
        return write_captured(captured)

    ckpt_engine.write_captured = controlled


def _release(folder: Path) -> None:
    for rank in (0, 1):
        (folder / f"hold{rank}").unlink(missing_ok=True)


def overlap(leader, step, weights, root: Path, folder: Path, report: dict) -> None:
    """Save at step 1 with both writers held, train step 2, release, commit, resume, replay step 2."""
    import torch

    from gyre.learner.checkpoint import store as ckpt
    from gyre.learner.checkpoint.async_save import BackgroundSaver
    from gyre.learner.checkpoint.request import CheckpointRequest

    step(0)
    at_step1 = weights()
    saver = BackgroundSaver()
    for rank in (0, 1):
        (folder / f"hold{rank}").touch()
    future = leader.save_checkpoint(CheckpointRequest(root, pending_lease_ids=["a"], fingerprint="fp", saver=saver))
    report["returned"] = type(future).__name__
    assert isinstance(future, Future), f"save_checkpoint returned {future!r}, not a Future (synchronous)"
    step(1)  # both ranks train while both writers are held
    report["pending_after_step"] = not future.done()
    report["shards_on_disk_after_step"] = sorted(p.name for p in ckpt.temp_path(root, 1).rglob("*.pt"))
    report["committed_after_step"] = ckpt.checkpoint_path(root, 1).exists()
    at_step2 = weights()
    _release(folder)
    path = future.result(timeout=300)
    meta = ckpt.verify(path)
    report["committed"] = {"path": path.name, "step": meta.step, "world_size": meta.world_size,
                           "leases": meta.pending_lease_ids}
    report["files"] = sorted(json.loads((path / ckpt.MANIFEST).read_text())["files"])
    leader.load_checkpoint(path, fingerprint="fp")  # both ranks load their shard and RNG
    report["resumed_at"] = [leader.step, leader.version]
    report["resumed_weights_equal_step1"] = all(torch.equal(t, at_step1[n]) for n, t in weights().items())
    step(1)
    report["replayed_step_equal"] = all(torch.equal(t, at_step2[n]) for n, t in weights().items())
    report["step2_moved_weights"] = not all(torch.equal(at_step1[n], at_step2[n]) for n in at_step1)
    saver.shutdown()


def retry(leader, step, weights, root: Path, folder: Path, report: dict) -> None:
    """Rank 0's write of the step-1 save fails after rank 1 marked its shard; the retried save of step 1 must wait
    for rank 1's second write (held for ``HOLD_S``), then commit a checkpoint that resumes step 1's weights."""
    import torch

    from gyre.learner.checkpoint import store as ckpt
    from gyre.learner.checkpoint.async_save import BackgroundSaver
    from gyre.learner.checkpoint.request import CheckpointRequest

    step(0)
    at_step1 = weights()
    saver = BackgroundSaver()
    (folder / "fail0").touch()
    first = leader.save_checkpoint(CheckpointRequest(root, fingerprint="fp", saver=saver))
    assert isinstance(first, Future), f"save_checkpoint returned {first!r}, not a Future (synchronous)"
    report["first_error"] = type(first.exception(timeout=300)).__name__
    marker, deadline = ckpt.temp_path(root, 1) / ".shard_rank1.json", time.monotonic() + 300
    while not marker.exists():  # rank 1 wrote and marked its shard of the failed save
        assert time.monotonic() < deadline, "rank 1 never marked its shard of the first save"
        time.sleep(0.02)
    (folder / "hold1").touch()
    second = leader.save_checkpoint(CheckpointRequest(root, fingerprint="fp", saver=saver))
    time.sleep(HOLD_S)
    report["second_done_while_rank1_held"] = second.done()
    _release(folder)
    path = second.result(timeout=300)
    report["committed_step"] = ckpt.verify(path).step
    step(1)
    leader.load_checkpoint(path, fingerprint="fp")
    report["resumed_weights_equal_step1"] = all(torch.equal(t, at_step1[n]) for n, t in weights().items())
    saver.shutdown()


def rank_main(rank: int, env: dict, model: str, folder: str, zero_stage: int, scenario: str) -> None:
    os.environ.update(env | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"})
    import torch

    torch.set_num_threads(1)
    from gyre.learner import ranks
    from gyre.learner.batch import build_train_batch
    from tests.integration.test_learner_engine import ALGO, _engine, _table

    folder = Path(folder)
    report: dict = {}
    _control_writers(folder, rank, report)
    engine = _engine(model, dtype="fp32", zero_stage=zero_stage)
    try:
        if rank == 1:
            report["commands"] = ranks.follow(engine)
            return
        leader = ranks.LeaderEngine(engine, heartbeat_s=None)

        def step(seed: int) -> None:
            leader.train_step(build_train_batch(_table(seed=seed), 0, leader.version, ALGO))

        def weights() -> dict:
            return {n: t.clone() for n, t in leader.named_weights(dtype=None)}

        try:
            {"overlap": overlap, "retry": retry}[scenario](leader, step, weights, folder / "ckpt", folder, report)
        except BaseException:
            report["error"] = traceback.format_exc()[-3000:]
        finally:
            _release(folder)  # a failed run must not leave a writer held
            leader.stop_followers()
    finally:
        (folder / f"rank{rank}.json").write_text(json.dumps(report))


def run_pair(model, folder: Path, zero_stage: int, scenario: str) -> tuple[dict, dict]:
    store, env = rank_store(2)
    run_spawned(rank_main, lambda r: (r, env, str(model), str(folder), zero_stage, scenario), 2)
    del store
    leader, follower = (json.loads((folder / f"rank{r}.json").read_text()) for r in range(2))
    assert "error" not in leader, leader["error"]
    return leader, follower


@pytest.mark.parametrize("zero_stage", [2, 3], ids=["zero2", "zero3"])
def test_two_ranks_save_in_the_background_while_training_continues_and_resume_exactly(tiny_llama, tmp_path,
                                                                                        zero_stage):
    leader, follower = run_pair(tiny_llama, tmp_path, zero_stage, "overlap")
    assert leader["returned"] == "Future"
    # the next step completed on both ranks while the save was pending and no shard was on disk
    assert leader["pending_after_step"] and not leader["committed_after_step"]
    assert leader["shards_on_disk_after_step"] == []
    assert leader["writes"] == follower["writes"] == ["held"]  # rank 1 saved in the background too
    # 3 train steps, a save, a load; under ZeRO-3 also the 4 weight gathers (collective there, rank 0's alone at 2)
    assert follower["commands"] == (5 if zero_stage == 2 else 9)
    assert leader["committed"] == {"path": "global_step_1", "step": 1, "world_size": 2, "leases": ["a"]}
    files = leader["files"]
    for rank in (0, 1):
        assert f"deepspeed/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in files, files
        if zero_stage == 3:  # each rank's partition of the weights is a file of its own
            assert f"deepspeed/zero_pp_rank_{rank}_mp_rank_00_model_states.pt" in files, files
        assert f"rng_rank{rank}.safetensors" in files
    assert not [f for f in files if ".shard_rank" in f]  # the markers are gone before the manifest
    assert leader["resumed_at"] == [1, 1] and leader["resumed_weights_equal_step1"]
    assert leader["step2_moved_weights"] and leader["replayed_step_equal"]


def test_a_retried_save_waits_for_the_ranks_new_shard_not_a_stale_marker(tiny_llama, tmp_path):
    leader, follower = run_pair(tiny_llama, tmp_path, 2, "retry")
    assert leader["writes"] == ["failed", "written"] and follower["writes"] == ["written", "held"]
    assert leader["first_error"] == "OSError"
    assert not leader["second_done_while_rank1_held"], "rank 0 committed on the marker of the failed save"
    assert leader["committed_step"] == 1 and leader["resumed_weights_equal_step1"]
