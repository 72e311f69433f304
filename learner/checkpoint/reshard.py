"""Resume a learner checkpoint on a different data-parallel world size, through DeepSpeed's universal
checkpoint (Lian et al. 2024, "Universal Checkpointing", arXiv:2406.18820; ``deepspeed.checkpoint``).

A ZeRO-1/2/3 checkpoint stores the fp32 master weights and the AdamW moments as one flat partition per
rank, so it only loads on the world size that wrote it. ``to_universal`` runs DeepSpeed's converter
(``deepspeed.checkpoint.ds_to_universal``, called as a function) once per checkpoint: it writes every
parameter's fp32 weight, ``exp_avg``, ``exp_avg_sq`` and step as a whole tensor, which any world size can
re-partition. ``load_resharded`` then has DeepSpeed load that into the running engine.

Layout: the universal form lives inside the checkpoint it was made from, outside its manifest::

    global_step_N/
        manifest.json, metadata.json, deepspeed/, rng_rank{r}.* ...   the checkpoint (untouched)
        universal/                    DeepSpeed universal checkpoint (tag "universal", load dir global_step_N)
            mp_rank_00_model_states.pt, zero/{param}/{fp32,exp_avg,exp_avg_sq,step}.pt
            manifest.json             sha256 + bytes of every file above, and the sha256 of the
                                      ``deepspeed/`` files it was converted from — written last

The checkpoint's own manifest lists only its files, so ``learner.checkpoint.store.verify`` still passes, and
``prune`` deletes the universal form with its checkpoint. Conversion is atomic and idempotent: it writes
into ``global_step_N/.universal.tmp-{pid}/``, writes the manifest last, fsyncs, and renames; a
``universal/`` whose manifest verifies (against its files and its source) is reused, a bad one is
re-made. The files inside ``universal/`` are DeepSpeed's own ``torch.save`` format, like ``deepspeed/``.

Supported: ZeRO stages 1, 2 and 3 (fp32 or bf16; the resuming learner must use the saved stage).
Refused with a ``CheckpointError`` naming the stage: ZeRO-0, whose checkpoint holds no ZeRO partitions
for the converter to read (``learner.checkpoint.store.reshard_refusal``, ``learner.checkpoint.store.REFUSED_STAGES``).
Like ``learner.engine``, this module imports deepspeed (lazily, inside the functions that need it).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import structlog
import torch.distributed as dist

from gyre.learner.checkpoint import store as ckpt
from gyre.learner.checkpoint.request import CheckpointedLearner

log = structlog.get_logger("learner.reshard")

UNIVERSAL = "universal"
"""Directory (inside ``global_step_N``) and DeepSpeed tag of the universal form."""
DEEPSPEED = "deepspeed"
"""Directory (and DeepSpeed tag) of the checkpoint's ZeRO state, written by ``ckpt_engine``."""


# ---- conversion ---------------------------------------------------------------------------------
def _entry(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _source_digest(checkpoint_dir: Path) -> dict[str, str]:
    """sha256 (from the checkpoint's manifest) of each ``deepspeed/`` file the conversion reads."""
    files = json.loads((checkpoint_dir / ckpt.MANIFEST).read_text())["files"]
    return {name: want["sha256"] for name, want in sorted(files.items()) if name.startswith(f"{DEEPSPEED}/")}


def universal_problem(checkpoint_dir: Path) -> str | None:
    """Why ``checkpoint_dir/universal`` is not a complete conversion of this checkpoint, or ``None``
    when its manifest verifies (every listed file present with its bytes and sha256, same source)."""
    checkpoint_dir = Path(checkpoint_dir)
    out = checkpoint_dir / UNIVERSAL
    try:
        manifest = json.loads((out / ckpt.MANIFEST).read_text())
        files, source = manifest["files"], manifest["source"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        return f"{out / ckpt.MANIFEST} is missing or unreadable ({exc})"
    if source != _source_digest(checkpoint_dir):
        return f"{out} was converted from other {DEEPSPEED}/ files than this checkpoint's"
    for name, want in files.items():
        file = out / name
        if not file.is_file() or _entry(file) != want:
            return f"{file} is missing or differs from {out / ckpt.MANIFEST}"
    return None


def _convert(source: Path, out: Path) -> None:
    """Run DeepSpeed's ZeRO-1/2/3 → universal converter in this process (one worker: no process pool)."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = argparse.Namespace(input_folder=str(source), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    chatter = io.StringIO()  # the converter prints progress and tqdm bars
    with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
        ds_to_universal(args)


def to_universal(checkpoint_dir: Path) -> Path:
    """Convert ``checkpoint_dir/deepspeed`` (a committed ``global_step_N``) into
    ``checkpoint_dir/universal`` and return that path; reuse it when it already verifies.

    Run it on one process only (rank 0 of the learner that resumes). Memory: about the checkpoint's
    size (one rank's partitions at a time); disk: the fp32 weights and both AdamW moments again.

    Raises:
        learner.checkpoint.CheckpointError: the checkpoint does not verify, has no ``deepspeed/``, or
            was written with a ZeRO stage the converter cannot handle (the message names the stage).
    """
    checkpoint_dir = Path(checkpoint_dir)
    meta = ckpt.verify(checkpoint_dir)
    if refusal := ckpt.reshard_refusal(checkpoint_dir):
        raise ckpt.CheckpointError(f"checkpoint {checkpoint_dir}: {refusal}")
    if not (checkpoint_dir / DEEPSPEED).is_dir():
        raise ckpt.CheckpointError(f"checkpoint {checkpoint_dir} has no {DEEPSPEED}/ directory to convert")
    final = checkpoint_dir / UNIVERSAL
    if final.exists():
        if (problem := universal_problem(checkpoint_dir)) is None:
            return final
        log.warning("universal_checkpoint_remade", path=str(final), reason=problem)
    for stale in checkpoint_dir.glob(f".{UNIVERSAL}.*"):  # one learner per checkpoint root at a time
        shutil.rmtree(stale, ignore_errors=True)
    scratch = checkpoint_dir / f".{UNIVERSAL}.tmp-{os.getpid()}"
    out = scratch / UNIVERSAL  # the converter also writes ``latest_universal`` next to ``out``
    _convert(checkpoint_dir / DEEPSPEED, out)
    files = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        ckpt.fsync_path(path)
        files[path.relative_to(out).as_posix()] = _entry(path)
    manifest = {"format_version": 1, "step": meta.step, "source": _source_digest(checkpoint_dir), "files": files}
    with open(out / ckpt.MANIFEST, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for d in sorted((p for p in out.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [out]:
        ckpt.fsync_path(d)
    if final.exists():
        final.rename(scratch / "old")
    out.rename(final)
    ckpt.fsync_path(checkpoint_dir)
    shutil.rmtree(scratch, ignore_errors=True)
    log.info("universal_checkpoint_written", path=str(final), step=meta.step, files=len(files),
             bytes=sum(e["bytes"] for e in files.values()))
    return final


# ---- loading ------------------------------------------------------------------------------------
def _convert_on_rank0(checkpoint_dir: Path) -> None:
    """Rank 0 converts while the others wait; a failure on rank 0 is raised on every rank (its message
    broadcast as UTF-8 bytes, ``learner.ranks.broadcast_bytes``; empty means success)."""
    from gyre.learner.ranks import broadcast_bytes

    if dist.get_rank() == 0:
        try:
            to_universal(checkpoint_dir)
        except Exception as exc:  # propagate to the other ranks instead of leaving them in a barrier
            broadcast_bytes(f"{type(exc).__name__}: {exc}".encode())
            raise
        broadcast_bytes(b"")
        return
    error = broadcast_bytes(None).decode()
    if error:
        raise ckpt.CheckpointError(f"checkpoint {checkpoint_dir}: universal conversion failed on rank 0: {error}")


def load_resharded(learner: CheckpointedLearner, checkpoint_dir: Path,
                   saved_world_size: int) -> ckpt.CheckpointMetadata:
    """Restore ``learner`` from a checkpoint written by ``saved_world_size`` ranks on the current,
    different world size: weights, AdamW moments and step, ``step``, ``version``, the KL controller and RNG.

    Rank 0 converts the checkpoint (``to_universal``, reused if done before); then every rank has
    DeepSpeed load ``universal/`` with ``load_universal`` switched on for the call (the engine reads
    ``"checkpoint": {"load_universal": ...}`` per load, so the live engine's flag is set and restored).
    Rank ``r`` restores ``rng_rank{r}`` when the checkpoint has it, else rank 0's (logged).

    Raises:
        learner.checkpoint.CheckpointError: unsupported ZeRO stage (saved or current), the current ZeRO
            stage differs from the saved one, conversion failed, or DeepSpeed loaded nothing.
    """
    checkpoint_dir = Path(checkpoint_dir)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if refusal := ckpt.reshard_refusal(checkpoint_dir):
        raise ckpt.CheckpointError(f"checkpoint {checkpoint_dir} (world size {saved_world_size}) cannot be resumed "
                                   f"on world size {world_size}: {refusal}")
    saved_stage = json.loads((checkpoint_dir / ckpt.LEARNER_CONFIG).read_text())["zero_stage"]
    if learner.config.zero_stage != saved_stage:
        raise ckpt.CheckpointError(f"checkpoint {checkpoint_dir}: resharding keeps the ZeRO stage; the checkpoint "
                                   f"has stage {saved_stage}, this learner stage {learner.config.zero_stage}")
    meta = ckpt.CheckpointMetadata.from_dict(json.loads((checkpoint_dir / ckpt.METADATA).read_text()))
    _convert_on_rank0(checkpoint_dir)
    ds_config = learner.engine._config  # no public setter; DeepSpeed reads it on every load_checkpoint
    before = ds_config.load_universal_checkpoint
    ds_config.load_universal_checkpoint = True
    try:
        loaded, _ = learner.engine.load_checkpoint(str(checkpoint_dir), tag=UNIVERSAL)
    finally:
        ds_config.load_universal_checkpoint = before
    if loaded is None:
        raise ckpt.CheckpointError(f"checkpoint {checkpoint_dir}: DeepSpeed found no state under {UNIVERSAL}/")
    rng_rank = rank if (checkpoint_dir / f"rng_rank{rank}.safetensors").is_file() else 0
    if rng_rank != rank:
        log.info("rng_from_rank0", path=str(checkpoint_dir), rank=rank, saved_world_size=saved_world_size)
    ckpt.load_rng(checkpoint_dir, rng_rank)
    learner.step, learner.version = meta.step, meta.policy_version
    learner.kl_ctrl.load_state_dict(meta.kl_ctrl)
    log.info("checkpoint_resharded", path=str(checkpoint_dir), saved_world_size=saved_world_size,
             world_size=world_size, step=meta.step, version=meta.policy_version)
    return meta
