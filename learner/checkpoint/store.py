"""Learner checkpoints you can trust: layout, commit protocol, verification, resume selection.

Layout of one checkpoint (``{root}/global_step_{N}/``)::

    deepspeed/...                      DeepSpeed's own files (model, optimizer, LR schedule if any)
    rng_rank{r}.safetensors            torch CPU (and CUDA) RNG + numpy MT19937 key, per rank
    rng_rank{r}.json                   python ``random`` state + numpy's scalar fields, per rank
    learner_config.json                ``LearnerConfig`` that wrote it (``gyre export`` rebuilds the engine)
    algorithm_config.json              ``AlgorithmConfig`` (a critic's ``value_head`` is part of the state)
    metadata.json                      ``CheckpointMetadata``
    manifest.json                      ``{"files": {relpath: {"bytes", "sha256"}}, ...}`` — written last

Commit protocol (docs/concepts/architecture.md): everything is written into ``global_step_{N}.tmp-{pid}/``; each file
and directory is fsync'd; the manifest is written (and fsync'd) last; the temp dir is renamed to
``global_step_{N}`` and ``root`` fsync'd. A crash at any point leaves no directory that looks
complete: a temp dir is ignored, and a final dir whose manifest does not verify is skipped by name.

Pure: no deepspeed import (``learner.engine`` passes a callable that writes DeepSpeed's part).
Fault points for crash tests: ``GYRE_FAULT_POINT=learner.ckpt.<phase>[#n]`` makes the process
SIGKILL itself (at the n-th hit; see ``faults``) at ``files_written``, ``before_manifest``, ``before_rename`` or ``after_rename``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Collection
from typing import Literal

import numpy as np
import structlog
import torch
from safetensors.torch import load_file, save_file

from gyre.faults import fault_point
from gyre.utils.durable import fsync_path
from gyre.proto.trajectory import SCHEMA_VERSION
from gyre.proto.trajectory_upgrade import UPGRADABLE

log = structlog.get_logger("learner.checkpoint")

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
METADATA = "metadata.json"
LEARNER_CONFIG = "learner_config.json"
ALGORITHM_CONFIG = "algorithm_config.json"
_NAME = re.compile(r"^global_step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or may not be resumed; the message names its path."""


@dataclass(frozen=True)
class CheckpointMetadata:
    """What ``metadata.json`` holds besides the tensors."""

    step: int
    """Optimizer steps taken when saved."""
    policy_version: int
    """Policy version of the saved weights."""
    pending_lease_ids: list[str] = field(default_factory=list)
    """Replay leases whose batches this checkpoint trained on and which were not yet acked at save
    time; the learner acks them right after the commit (and again, tolerating unknown ids, on resume)."""
    pending_group_ids: list[str] = field(default_factory=list)
    """``group_id`` of every group in ``pending_lease_ids``' batches (the groups this checkpoint's steps
    trained on); lets a resumed learner re-journal the ``commit`` event a crash cut off (``proto.journal``).
    Empty in checkpoints written before this field existed."""
    acked_lease_count: int = 0
    """Leases acked before this checkpoint (cumulative)."""
    config_hash: str = ""
    """sha256 of the learner config JSON (a change is logged on resume, not refused)."""
    fingerprint: str = ""
    """Task/dataset fingerprint given by the caller; a mismatch refuses resume unless forced."""
    schema_version: int = SCHEMA_VERSION
    """``proto.trajectory.SCHEMA_VERSION`` the learner trained on; a mismatch always refuses resume."""
    world_size: int = 1
    """Data-parallel ranks that wrote the checkpoint (a different world size resumes through
    ``learner.checkpoint.reshard``'s universal checkpoint; ZeRO-0 checkpoints are refused)."""
    wall_time: float = 0.0
    """Unix time (seconds) of the save."""
    kl_ctrl: dict = field(default_factory=dict)
    """The KL controller's state (``learner.algo.kl_control.KLController.state_dict``: its exact current coefficient),
    restored on resume; empty in checkpoints written before it was saved (the controller restarts at ``kl_coef``)."""
    spike_save: dict = field(default_factory=dict)
    """The loss-spike detector's state (``learner.checkpoint.spike.SpikeDetector.state_dict``: recent values, hold, count),
    restored on resume; empty when none was saved (the detector starts empty)."""
    format_version: int = FORMAT_VERSION
    """Version of this layout."""

    @classmethod
    def from_dict(cls, d: dict) -> CheckpointMetadata:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


# ---- RNG ----------------------------------------------------------------------------------------
def save_rng(dir: Path, rank: int = 0) -> list[Path]:
    """Write this process's torch/numpy/python RNG states as safetensors + JSON (no pickle)."""
    dir = Path(dir)
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"torch_cpu": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype(np.int64))}
    if torch.cuda.is_available():
        tensors |= {f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    version, internal, gauss_next = random.getstate()
    doc = {"python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
           "numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}
    st, js = dir / f"rng_rank{rank}.safetensors", dir / f"rng_rank{rank}.json"
    save_file(tensors, str(st))
    js.write_text(json.dumps(doc))
    return [st, js]


def load_rng(dir: Path, rank: int = 0) -> None:
    """Restore what ``save_rng`` wrote for ``rank``."""
    dir = Path(dir)
    tensors = load_file(str(dir / f"rng_rank{rank}.safetensors"))
    doc = json.loads((dir / f"rng_rank{rank}.json").read_text())
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    n = doc["numpy"]
    np.random.set_state((n["kind"], tensors["numpy_keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = doc["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


# ---- commit -------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_path(root: Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def temp_path(root: Path, step: int, pid: int | None = None) -> Path:
    """The temp dir a save at ``step`` writes into (``pid``: the writing rank-0 process)."""
    return Path(root) / f"global_step_{step}.tmp-{pid or os.getpid()}"


def commit(tmp: Path, final: Path, metadata: CheckpointMetadata) -> Path:
    """Finish a checkpoint whose data files are in ``tmp``: metadata, fsyncs, manifest, atomic rename.

    An existing ``final`` (e.g. a corrupt one being re-made) is moved aside first and removed after.
    Returns ``final``.
    """
    tmp, final = Path(tmp), Path(final)
    (tmp / METADATA).write_text(json.dumps(asdict(metadata), indent=2, sort_keys=True))
    fault_point("learner.ckpt.files_written")
    files: dict[str, dict] = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        fsync_path(path)
        files[path.relative_to(tmp).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        fsync_path(d)
    fault_point("learner.ckpt.before_manifest")
    manifest = {"format_version": FORMAT_VERSION, "schema_version": metadata.schema_version,
                "config_hash": metadata.config_hash, "step": metadata.step, "files": files}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp)
    fault_point("learner.ckpt.before_rename")
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        final.rename(old)
    tmp.rename(final)
    fsync_path(final.parent)
    fault_point("learner.ckpt.after_rename")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def prune(root: Path, keep_last_n: int, protected: Collection[str] = ()) -> list[Path]:
    """Delete all but the newest ``keep_last_n`` committed checkpoints, plus stale temp dirs of other
    processes; returns what was removed. ``protected``: checkpoint names (``global_step_N``) kept past
    ``keep_last_n`` for now, e.g. while an archive upload still reads them (a later prune removes them)."""
    if keep_last_n < 1:
        raise ValueError(f"keep_last_n ({keep_last_n}) must be a positive integer")
    removed = [c for c in list_checkpoints(root)[:-keep_last_n] if c.name not in protected]
    removed += [p for p in Path(root).glob("global_step_*.*-*") if not p.name.endswith(f"-{os.getpid()}")]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    if removed:
        fsync_path(Path(root))
    return removed


# ---- verification and resume --------------------------------------------------------------------
def list_checkpoints(root: Path) -> list[Path]:
    """Committed-looking ``global_step_N`` dirs under ``root``, oldest first (temp dirs excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def verify(path: Path) -> CheckpointMetadata:
    """Check ``path``'s manifest (every listed file present with its size and sha256, metadata
    included); returns its metadata. Raises ``CheckpointError`` naming the checkpoint and the bad file."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is missing (incomplete save?)")
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())  # ValueError covers bad UTF-8 and bad JSON
        files = manifest["files"]
        entries = [(name, int(want["bytes"]), str(want["sha256"])) for name, want in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable: {exc!r}") from exc
    for name, want_bytes, want_sha in entries:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        size = file.stat().st_size
        if size != want_bytes:
            raise CheckpointError(f"checkpoint {path}: {name} has {size} bytes; manifest says {want_bytes} "
                                  "(truncated?)")
        if _sha256(file) != want_sha:
            raise CheckpointError(f"checkpoint {path}: {name} sha256 does not match the manifest (corrupt)")
    if METADATA not in files:
        raise CheckpointError(f"checkpoint {path}: manifest does not cover {METADATA}")
    return CheckpointMetadata.from_dict(json.loads((path / METADATA).read_text()))


def find_latest_verified(root: Path) -> Path | None:
    """The newest checkpoint under ``root`` whose manifest verifies; each bad one newer than it is
    named in a ``checkpoint_skipped`` warning. ``None`` when there is none."""
    for path in reversed(list_checkpoints(root)):
        try:
            verify(path)
            return path
        except CheckpointError as exc:  # recovery path: fall back to the previous checkpoint
            log.warning("checkpoint_skipped", path=str(path), reason=str(exc))
    return None


# ---- resume rules -------------------------------------------------------------------------------
SUPPORTED_STAGES = (1, 2, 3)
"""ZeRO stages whose checkpoints DeepSpeed's converter reads (``*_optim_states.pt`` partitions)."""
REFUSED_STAGES = {
    0: "ZeRO-0 writes no *_optim_states.pt partitions for DeepSpeed's universal converter to read",
}


def reshard_refusal(checkpoint_dir: Path) -> str | None:
    """Why the checkpoint at ``checkpoint_dir`` cannot be resharded (converted to a universal
    checkpoint), or ``None`` when it can. Reads only its ``learner_config.json``.

    Pure (no deepspeed import): ``check_resumable`` calls it before anything loads, and ``learner.checkpoint.reshard``
    before it converts.
    """
    path = Path(checkpoint_dir) / LEARNER_CONFIG
    try:
        stage = json.loads(path.read_text())["zero_stage"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        return f"{path} does not say which ZeRO stage wrote the checkpoint ({exc})"
    if stage not in SUPPORTED_STAGES:
        reason = REFUSED_STAGES.get(stage, "unknown stage")
        return (f"resharding needs ZeRO stage {', '.join(map(str, SUPPORTED_STAGES))}; the checkpoint was "
                f"written with ZeRO stage {stage} ({reason})")
    return None


def check_resumable(path: Path, meta: CheckpointMetadata, fingerprint: str, world_size: int,
                    config_hash: str = "", force: bool = False) -> None:
    """Refuse to resume from an incompatible checkpoint.

    Raises:
        CheckpointError: schema version neither ``SCHEMA_VERSION`` nor upgradable (always, naming both), world size differs and the
            checkpoint cannot be resharded (``reshard_refusal``: ZeRO-0, no learner config), or
            the task/dataset fingerprint differs (unless ``force``), listing each difference.
    """
    if meta.schema_version not in (SCHEMA_VERSION, *UPGRADABLE):  # an upgradable version's data reads as today's
        raise CheckpointError(f"checkpoint {path} was written with trajectory schema version "
                              f"{meta.schema_version}; this learner uses schema version {SCHEMA_VERSION} "
                              f"(and reads {UPGRADABLE})")
    if meta.world_size != world_size:
        if refusal := reshard_refusal(path):
            raise CheckpointError(f"checkpoint {path} was written by world size {meta.world_size}; this learner "
                                  f"has world size {world_size} and cannot reshard it: {refusal}")
        log.info("resume_reshard", path=str(path), saved_world_size=meta.world_size, world_size=world_size)
    if meta.fingerprint != fingerprint:
        diff = fingerprint_diff(meta.fingerprint, fingerprint)
        if not force:
            raise CheckpointError(f"checkpoint {path} is for a different task/dataset ({diff}); "
                                  "pass force=True (--force-resume) to resume anyway")
        log.warning("resume_forced", path=str(path), differs=diff)
    if config_hash and meta.config_hash and meta.config_hash != config_hash:
        log.warning("resume_config_changed", path=str(path), saved=meta.config_hash[:12], current=config_hash[:12])


def fingerprint_diff(saved: str, current: str) -> str:
    """What differs between two task/dataset fingerprints: for JSON objects (what the controller stores)
    one ``key.path: checkpoint X != current Y`` per differing leaf, else the two strings. A ``data_files``
    table (``{role: {relative path: sha256}}``, ``rollout.dataset_files.data_fingerprint``) is summarised as
    the files added, removed and changed, and its sibling ``data_tree`` hash is then not repeated."""
    try:
        a, b = json.loads(saved), json.loads(current)
    except ValueError:
        a = b = None
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return f"fingerprint: checkpoint {saved!r} != current {current!r}"
    lines: list[str] = []

    def walk(x, y, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            files_differ = x.get("data_files") != y.get("data_files")
            for key in sorted(set(x) | set(y)):
                sub = f"{path}.{key}" if path else key
                if key == "data_files" and files_differ:
                    lines.append(_files_diff(x.get(key), y.get(key), sub))
                elif not (key == "data_tree" and files_differ):
                    walk(x.get(key, "<missing>"), y.get(key, "<missing>"), sub)
        elif x != y:
            lines.append(f"{path}: checkpoint {json.dumps(x)} != current {json.dumps(y)}")

    walk(a, b, "")
    return "; ".join(lines)


def _files_diff(saved, current, path: str) -> str:
    """``path: files added [..], removed [..], changed [..]`` between two ``{role: {file: sha256}}`` tables."""
    def flat(table) -> dict[str, str]:
        table = table if isinstance(table, dict) else {}
        return {f"{role}/{name}": sha for role, files in table.items() if isinstance(files, dict)
                for name, sha in files.items()}

    a, b = flat(saved), flat(current)
    parts = [f"{what} {names}" for what, names in (
        ("added", sorted(set(b) - set(a))), ("removed", sorted(set(a) - set(b))),
        ("changed", sorted(k for k in set(a) & set(b) if a[k] != b[k]))) if names]
    return f"{path}: data files {', '.join(parts) or 'differ'}"


def resolve_resume(mode: Literal["auto", "none"] | str | Path, root: Path) -> Path | None:
    """The checkpoint to resume from: ``none`` → ``None``; ``auto`` → ``find_latest_verified(root)``
    (``None`` if there is none); otherwise ``mode`` is a checkpoint path, which must verify.

    Raises:
        CheckpointError: an explicit path that does not exist or does not verify.
    """
    if mode == "none":
        return None
    if mode == "auto":
        return find_latest_verified(root)
    path = Path(mode)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    verify(path)
    return path


def config_hash(config_json: str) -> str:
    """sha256 hex of a config's JSON text."""
    return hashlib.sha256(config_json.encode()).hexdigest()
