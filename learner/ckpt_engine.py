"""Checkpoint save/load of a ``LearnerEngine``: DeepSpeed's state plus gyre's layout and commit protocol
(``learner.checkpoint``). Kept apart from ``learner.engine`` (training) so the two can change separately."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch.distributed as dist

from learner import checkpoint as ckpt

if TYPE_CHECKING:
    from learner.engine import LearnerEngine

log = structlog.get_logger("learner")


def save_checkpoint(learner: LearnerEngine, root: Path, pending_lease_ids: list[str] = (), acked_lease_count: int = 0,
                    fingerprint: str = "", keep_last_n: int | None = None) -> Path:
    """Commit ``{root}/global_step_{step}`` (``learner.checkpoint`` layout and protocol): DeepSpeed
    state (weights, optimizer, LR schedule) under ``deepspeed/``, every rank's RNG, metadata, manifest.

    Returns the committed checkpoint's path (the same on every rank).
    """
    root = Path(root)
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    holder = [os.getpid()]
    dist.broadcast_object_list(holder, src=0)
    tmp = ckpt.temp_path(root, learner.step, holder[0])
    learner.engine.save_checkpoint(str(tmp), tag="deepspeed", save_latest=False)
    ckpt.save_rng(tmp, rank)
    if rank == 0:
        (tmp / ckpt.LEARNER_CONFIG).write_text(learner.config.model_dump_json(indent=2))
    dist.barrier()
    final = ckpt.checkpoint_path(root, learner.step)
    if rank == 0:
        meta = ckpt.CheckpointMetadata(
            step=learner.step, policy_version=learner.version, pending_lease_ids=list(pending_lease_ids),
            acked_lease_count=acked_lease_count, config_hash=learner.config_hash, fingerprint=fingerprint,
            world_size=dist.get_world_size(), wall_time=time.time())
        ckpt.commit(tmp, final, meta)
        if keep_last_n is not None:
            ckpt.prune(root, keep_last_n)
    dist.barrier()
    return final

def load_checkpoint(learner: LearnerEngine, path: Path, fingerprint: str = "", force: bool = False) -> ckpt.CheckpointMetadata:
    """Verify ``path`` (a ``global_step_N`` dir), check it may be resumed
    (``learner.checkpoint.check_resumable``), then restore weights, optimizer, LR schedule,
    ``step``, ``version`` and this rank's RNG, so training continues bit-identically.

    Raises:
        learner.checkpoint.CheckpointError: corrupt/incomplete, or refused (the message says why).
    """
    path = Path(path)
    meta = ckpt.verify(path)
    ckpt.check_resumable(path, meta, fingerprint, dist.get_world_size(), learner.config_hash, force)
    loaded, _ = learner.engine.load_checkpoint(str(path), tag="deepspeed")
    if loaded is None:
        raise ckpt.CheckpointError(f"checkpoint {path}: DeepSpeed found no state under deepspeed/")
    ckpt.load_rng(path, dist.get_rank())
    learner.step, learner.version = meta.step, meta.policy_version
    log.info("checkpoint_loaded", path=str(path), step=meta.step, version=meta.policy_version,
             pending_leases=len(meta.pending_lease_ids), fingerprint_ok=meta.fingerprint == fingerprint)
    return meta
