"""Checkpoint save/load of a learner engine (``learner.checkpoint.request.CheckpointedLearner``): DeepSpeed's state
plus gyre's layout and commit protocol (``learner.checkpoint.store``). Kept apart from ``learner.engine`` (training)
so the two can change separately; it reads the engine through that protocol, so it does not import it."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from gyre.learner.checkpoint import store as ckpt
from gyre.learner.checkpoint.async_save import (clear_shard_mark, mark_shard, snapshot, wait_for_shards,
                                                write_captured)
from gyre.learner.checkpoint.request import CheckpointedLearner, CheckpointRequest, commit_request
from gyre.learner.ranks import control_group

log = structlog.get_logger("learner")


def save_checkpoint(learner: CheckpointedLearner, request: CheckpointRequest) -> Path | Future:
    """Commit ``{request.root}/global_step_{step}`` (``learner.checkpoint.store`` layout and protocol): DeepSpeed
    state (weights, optimizer, LR schedule) under ``deepspeed/``, every rank's RNG, metadata (with the KL
    controller's state and ``request.spike_save``), manifest. Every rank of the learner calls it (DeepSpeed's save is
    collective); only rank 0 commits.

    With a ``request.saver`` the save is asynchronous, at any world size (``learner.checkpoint.async_save``): each
    rank clones its shard of the state to memory here (the only time training waits; the capture's collectives run
    in this, the training thread) and returns a ``Future``; the saver's thread writes the shard. On rank 0 the
    future resolves to the committed path once its own files are written, every other rank has marked its shard
    written (``async_save.wait_for_shards``: files, not collectives) and the commit is done; on the other ranks it
    resolves to the same path once their shard is written and marked (they never see the commit). ``result()``
    raises what the write raised (``async_save.ShardWaitError`` on rank 0 for another rank's failure or timeout).
    Without a saver the save is synchronous and returns the committed path (the same on every rank).
    ``request.after_commit(path)`` runs on rank 0 right after the commit and pruning (in the saver's thread for an
    async save), e.g. to mirror the checkpoint before its leases are acked.
    """
    root, saver = request.root, request.saver
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    holder = torch.tensor([os.getpid()], dtype=torch.int64)  # rank 0's pid names the temp dir on every rank
    dist.broadcast(holder, src=0, group=control_group())  # a CPU tensor: gloo, also when training runs on NCCL
    tmp = ckpt.temp_path(root, learner.step, int(holder.item()))
    final = ckpt.checkpoint_path(root, learner.step)
    meta = ckpt.CheckpointMetadata(
        step=learner.step, policy_version=learner.version, pending_lease_ids=list(request.pending_lease_ids),
        pending_group_ids=list(request.pending_group_ids),
        acked_lease_count=request.acked_lease_count, config_hash=learner.config_hash, fingerprint=request.fingerprint,
        world_size=world, wall_time=time.time(), kl_ctrl=learner.kl_ctrl.state_dict(),
        spike_save=dict(request.spike_save))
    if saver is not None:
        saver.wait()  # one save in flight per rank: its temp dir and pruning must not interleave with this one
        clear_shard_mark(tmp, rank)  # a retry of this step after a failed save: its marker is not this save's
        captured = capture(learner.engine, tmp, "deepspeed")
        side_files = _write_side_files(learner, tmp, rank)
        if rank == 0:
            def finish() -> Path:
                write_captured(captured)
                captured.clear()  # free the in-memory copy as soon as it is on disk
                wait_for_shards(tmp, world)
                return _commit(tmp, final, meta, request)
        else:
            def finish() -> Path:
                paths = [path for path, _ in captured] + side_files
                try:
                    write_captured(captured)
                except BaseException as exc:  # tell rank 0 at once instead of letting it time out
                    mark_shard(tmp, rank, [], error=exc)
                    raise
                finally:
                    captured.clear()
                mark_shard(tmp, rank, paths)
                return final

        return saver.submit(finish)
    learner.engine.save_checkpoint(str(tmp), tag="deepspeed", save_latest=False)
    _write_side_files(learner, tmp, rank)
    dist.barrier()
    if rank == 0:
        _commit(tmp, final, meta, request)
    dist.barrier()
    return final


def _write_side_files(learner: CheckpointedLearner, tmp: Path, rank: int) -> list[Path]:
    """This rank's RNG state and (rank 0) the learner config, captured at save time; returns the paths written."""
    paths = ckpt.save_rng(tmp, rank)
    if rank == 0:
        paths += [tmp / ckpt.LEARNER_CONFIG, tmp / ckpt.ALGORITHM_CONFIG]
        paths[-2].write_text(learner.config.model_dump_json(indent=2))
        paths[-1].write_text(learner.algo.model_dump_json(indent=2))
    return paths


def _commit(tmp: Path, final: Path, meta: ckpt.CheckpointMetadata, request: CheckpointRequest) -> Path:
    return commit_request(tmp, final, meta, request)


def load_checkpoint(learner: CheckpointedLearner, path: Path, fingerprint: str = "", force: bool = False) -> ckpt.CheckpointMetadata:
    """Verify ``path`` (a ``global_step_N`` dir), check it may be resumed
    (``learner.checkpoint.store.check_resumable``), then restore weights, optimizer, LR schedule,
    ``step``, ``version``, the KL controller (``learner.algo.kl_control``) and this rank's RNG, so training continues
    bit-identically.

    Raises:
        learner.checkpoint.CheckpointError: corrupt/incomplete, or refused (the message says why).
    """
    path = Path(path)
    meta = ckpt.verify(path)
    ckpt.check_resumable(path, meta, fingerprint, dist.get_world_size(), learner.config_hash, force)
    if meta.world_size != dist.get_world_size():  # via DeepSpeed's universal checkpoint
        from gyre.learner.checkpoint.reshard import load_resharded

        return load_resharded(learner, path, meta.world_size)
    loaded, _ = learner.engine.load_checkpoint(str(path), tag="deepspeed")
    if loaded is None:
        raise ckpt.CheckpointError(f"checkpoint {path}: DeepSpeed found no state under deepspeed/")
    ckpt.load_rng(path, dist.get_rank())
    learner.step, learner.version = meta.step, meta.policy_version
    learner.kl_ctrl.load_state_dict(meta.kl_ctrl)
    log.info("checkpoint_loaded", path=str(path), step=meta.step, version=meta.policy_version,
             pending_leases=len(meta.pending_lease_ids), fingerprint_ok=meta.fingerprint == fingerprint)
    return meta


class SnapshotCheckpointEngine(CheckpointEngine):
    """A DeepSpeed ``CheckpointEngine`` whose ``save`` captures ``(path, snapshot(state_dict))`` in
    ``captured`` instead of writing; directories are still created. ``load`` is torch's (unused: the
    engine's own checkpoint engine is restored before any load)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.name = "GyreSnapshotCheckpointEngine"
        self.captured: list[tuple[str, Any]] = []

    def create(self, info: CheckpointCommitInfo) -> None:
        self.captured = []

    def save(self, state_dict, path: str) -> None:
        self.captured.append((str(path), snapshot(state_dict)))

    def load(self, path: str, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # ``snapshot`` already clones every tensor


def capture(ds_engine, save_dir: Path, tag: str) -> list[tuple[str, Any]]:
    """Run ``ds_engine.save_checkpoint(save_dir, tag)`` with a ``SnapshotCheckpointEngine`` and return
    what it would have written, as ``[(path, state)]``; the engine's own checkpoint engine is restored
    even on error. Small side files DeepSpeed writes directly (``zero_to_fp32.py``) are on disk."""
    original = ds_engine.checkpoint_engine
    snap = SnapshotCheckpointEngine()
    ds_engine.checkpoint_engine = snap
    try:
        ds_engine.save_checkpoint(str(save_dir), tag=tag, save_latest=False)
    finally:
        ds_engine.checkpoint_engine = original
    return snap.captured
