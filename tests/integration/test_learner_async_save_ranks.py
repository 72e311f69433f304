"""Async checkpoint save with two learner ranks (``learner.checkpoint.async_save``): real DeepSpeed (ZeRO-2 and
ZeRO-3, where each rank also writes its own partition of the weights; fp32, CPU/gloo) in two spawned processes,
rank 0 a ``LeaderEngine`` and rank 1 ``follow``-ing it, as in the learner service.

The overlap is forced, not hoped for: on both ranks the background writer (``write_captured``, wrapped here)
holds until a gate file exists, and rank 0 creates it only after the next training step returned. So
``save_checkpoint`` must return (a ``Future``) before any shard is written, the next ``train_step`` (a
collective: rank 1 trains in it too) must complete while both writers are held, and only then does the save
commit: rank 0 waits for rank 1's shard marker, not for a collective. The committed checkpoint holds both ranks'
shards and resumes exactly: loading it and replaying the step gives the same weights bit for bit. With the old
synchronous multi-rank save ``save_checkpoint`` returned a path after writing every file, and this test fails.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path

import pytest

from tests.rendezvous import rank_store

pytestmark = pytest.mark.slow

GATE = "stepped"
"""Created by rank 0 after the training step that runs while the save is in flight; the writers wait for it."""


def _gate_writers(folder: Path, report: dict) -> None:
    """Make this process's background writer wait for ``folder/GATE`` (and refuse to run in the training thread,
    where waiting would deadlock: the gate is set by the training thread)."""
    import gyre.learner.checkpoint.engine as ckpt_engine

    write_captured = ckpt_engine.write_captured

    def gated(captured):
        if threading.current_thread() is threading.main_thread():
            raise AssertionError("the shard was written in the training thread (not async)")
        deadline = time.monotonic() + 300
        while not (folder / GATE).exists():
            assert time.monotonic() < deadline, "the training step did not finish within 300 s of the save"
            time.sleep(0.02)
        report["writer_started_after_gate"] = True
        return write_captured(captured)

    ckpt_engine.write_captured = gated


def rank_main(rank: int, env: dict, model: str, folder: str, zero_stage: int) -> None:
    os.environ.update(env | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"})
    import torch

    torch.set_num_threads(1)
    from gyre.learner import ranks
    from gyre.learner.batch import build_train_batch
    from gyre.learner.checkpoint import store as ckpt
    from gyre.learner.checkpoint.async_save import BackgroundSaver
    from gyre.learner.checkpoint.request import CheckpointRequest
    from gyre.learner.engine import LearnerEngine
    from tests.integration.test_learner_engine import ALGO, _engine, _table

    folder = Path(folder)
    report: dict = {}
    _gate_writers(folder, report)
    engine: LearnerEngine = _engine(model, dtype="fp32", zero_stage=zero_stage)
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
            root = folder / "ckpt"
            step(0)
            at_step1 = weights()
            saver = BackgroundSaver()
            t0 = time.monotonic()
            future = leader.save_checkpoint(CheckpointRequest(root, pending_lease_ids=["a"], fingerprint="fp",
                                                              saver=saver))
            report["save_returned_s"] = time.monotonic() - t0
            report["returned"] = type(future).__name__
            assert isinstance(future, Future), f"save_checkpoint returned {future!r}, not a Future (synchronous)"
            step(1)  # both ranks train while both writers are held
            tmp = ckpt.temp_path(root, 1)
            report["pending_after_step"] = not future.done()
            report["shards_on_disk_after_step"] = sorted(p.name for p in tmp.rglob("*.pt"))
            report["committed_after_step"] = ckpt.checkpoint_path(root, 1).exists()
            at_step2 = weights()
            (folder / GATE).touch()
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
        except BaseException:
            report["error"] = traceback.format_exc()[-3000:]
        finally:
            (folder / GATE).touch()  # a failed run must not leave rank 1's writer held
            leader.stop_followers()
    finally:
        (folder / f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.parametrize("zero_stage", [2, 3], ids=["zero2", "zero3"])
def test_two_ranks_save_in_the_background_while_training_continues_and_resume_exactly(tiny_llama, tmp_path,
                                                                                        zero_stage):
    store, env = rank_store(2)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, env, str(tiny_llama), str(tmp_path), zero_stage))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        assert p.exitcode == 0, f"rank exited {p.exitcode}"
    del store
    leader, follower = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert "error" not in leader, leader["error"]
    assert leader["returned"] == "Future"
    # the next step completed on both ranks while the save was pending and no shard was on disk
    assert leader["pending_after_step"] and not leader["committed_after_step"]
    assert leader["shards_on_disk_after_step"] == []
    assert leader["writer_started_after_gate"] and follower["writer_started_after_gate"]  # rank 1 saved async too
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
