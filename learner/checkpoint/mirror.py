"""Double-written checkpoints: a mirror directory (ideally another disk) and resume across tiers.

After ``learner.checkpoint.store.commit`` finishes ``{root}/global_step_N``, ``mirror_checkpoint`` copies it to
``{mirror_root}/global_step_N`` with the same commit protocol (docs/concepts/architecture.md): files are copied into
``global_step_N.tmp-{pid}`` while each one's size and sha256 are checked against the source manifest,
files and dirs are fsync'd, the manifest is written last and fsync'd, the temp dir is renamed and the
parent fsync'd; then the mirror is pruned to the same ``keep_last_n``.

``resolve_resume`` (a superset of ``learner.checkpoint.store.resolve_resume``) picks, for ``auto``, the newest
step that verifies in the primary root or the mirror (primary preferred at equal step), naming every
skipped copy in a ``checkpoint_skipped`` warning, and repairs the primary from the mirror when the mirror's
copy is chosen; when no local copy verifies it falls back to the newest archived checkpoint
(``learner.archive``) that fetches and verifies. Fault points for crash tests:
``learner.mirror.before_manifest`` and ``learner.mirror.before_rename`` (see ``faults``).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Literal

import structlog
from pydantic import BaseModel, ConfigDict

from gyre.learner.checkpoint.archive import (ArchiveConfig, HashingReader, check_copied, fetch_checkpoint, list_archived,
                             manifest_files, rename_into_place, step_of)
from gyre.faults import fault_point
from gyre.learner.checkpoint.store import (MANIFEST, CheckpointError, checkpoint_path, fsync_path,
                                list_checkpoints, prune, temp_path, verify)

log = structlog.get_logger("learner.mirror")
_NAME = re.compile(r"^global_step_\d+$")


class CheckpointTiersConfig(BaseModel):
    """Where committed checkpoints are replicated besides the primary checkpoint dir."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mirror_dir: Path | None = None
    """Second directory (ideally another disk) every checkpoint is copied to after it commits; pruned to
    the same ``keep_last_n``. ``None``: no mirror."""
    archive: ArchiveConfig | None = None
    """Object-storage archive tier (``learner.archive``). ``None``: no archive."""


def copy_commit(src: Path, final: Path) -> Path:
    """Copy the committed checkpoint ``src`` to ``final`` with the commit protocol; returns ``final``.
    Only the files the manifest lists are copied; an existing ``final`` is replaced.

    Raises:
        CheckpointError: ``src`` has no readable manifest, or a file is missing or differs from it while
            copying (the temp dir is removed; ``final`` is untouched).
        ValueError: ``final`` is not named ``global_step_N``.
    """
    src, final = Path(src), Path(final)
    if not (src / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint {src}: {MANIFEST} is missing (incomplete save?)")
    manifest_bytes = (src / MANIFEST).read_bytes()
    files = manifest_files(manifest_bytes, str(src))
    tmp = temp_path(final.parent, step_of(final.name))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name, want in sorted(files.items()):
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(src / name, "rb") as raw, open(tmp / name, "wb") as dst:
                    reader = HashingReader(raw)
                    shutil.copyfileobj(reader, dst, 1 << 20)
                    dst.flush()
                    os.fsync(dst.fileno())
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {src}: {name} is missing") from None
            check_copied(reader, want, name, str(src))
        for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            fsync_path(d)
        fault_point("learner.mirror.before_manifest")
        with open(tmp / MANIFEST, "wb") as f:
            f.write(manifest_bytes)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        fault_point("learner.mirror.before_rename")
        rename_into_place(tmp, final)
    except BaseException:  # cleanup path: never leave a half-copied temp dir, then re-raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def mirror_checkpoint(path: Path, mirror_root: Path, keep_last_n: int) -> Path:
    """Copy the committed checkpoint ``path`` (``…/global_step_N``) to ``{mirror_root}/global_step_N``
    (``copy_commit``), then prune the mirror to ``keep_last_n``. Returns the mirror's copy.

    Raises:
        ValueError: ``keep_last_n`` < 1, ``path`` not named ``global_step_N``, or ``mirror_root`` is
            ``path``'s own directory.
        CheckpointError: as ``copy_commit`` (e.g. the primary got corrupt before it was mirrored).
    """
    path, mirror_root, t0 = Path(path), Path(mirror_root), time.monotonic()
    if keep_last_n < 1:
        raise ValueError(f"keep_last_n ({keep_last_n}) must be a positive integer")
    if mirror_root.resolve() == path.parent.resolve():
        raise ValueError(f"mirror_root ({mirror_root}) is the checkpoint's own directory; expected another one")
    copy = copy_commit(path, checkpoint_path(mirror_root, step_of(path.name)))
    removed = prune(mirror_root, keep_last_n)
    log.info("checkpoint_mirrored", path=str(path), mirror=str(copy), pruned=[p.name for p in removed],
             seconds=round(time.monotonic() - t0, 3))
    return copy


# ---- resume --------------------------------------------------------------------------------------
def _verifies(path: Path) -> bool:
    try:
        verify(path)
        return True
    except CheckpointError as exc:  # recovery path: name it and try the next copy
        log.warning("checkpoint_skipped", path=str(path), reason=str(exc))
        return False


def _repair_from_mirror(mirror_copy: Path, primary: Path) -> Path:
    """Copy the verified ``mirror_copy`` back to ``primary``; returns the copy to resume from."""
    try:
        copy_commit(mirror_copy, primary)
    except OSError as exc:  # recovery path: the primary disk may be full or read-only; resume from the mirror
        log.warning("checkpoint_repair_failed", path=str(primary), mirror=str(mirror_copy),
                    error=f"{type(exc).__name__}: {exc}")
        return mirror_copy
    log.warning("checkpoint_repaired_from_mirror", path=str(primary), mirror=str(mirror_copy))
    return primary


def _from_archive(root: Path, archive: ArchiveConfig) -> Path | None:
    for step in reversed(list_archived(archive)):
        try:
            path = fetch_checkpoint(step, root, archive)
        except CheckpointError as exc:  # recovery path: name it and try the previous archived step
            log.warning("checkpoint_skipped", path=f"{archive.url}/global_step_{step}", reason=str(exc))
            continue
        log.error("resume_from_archive", path=str(path), url=f"{archive.url}/global_step_{step}",
                  reason="no local checkpoint (primary or mirror) verifies")
        return path
    return None


def find_latest_across(root: Path, mirror_root: Path | None = None,
                       archive: ArchiveConfig | None = None) -> Path | None:
    """``auto`` resume: the newest step that verifies in ``root`` or ``mirror_root`` (primary preferred at
    equal step; a mirror copy chosen is first copied back to ``root``), else the newest archived step that
    fetches and verifies (downloaded into ``root``), else ``None``. Every skipped copy is named in a
    ``checkpoint_skipped`` warning."""
    primary = {step_of(p.name): p for p in list_checkpoints(root)}
    mirror = {step_of(p.name): p for p in list_checkpoints(mirror_root)} if mirror_root is not None else {}
    for step in sorted(set(primary) | set(mirror), reverse=True):
        if step in primary and _verifies(primary[step]):
            return primary[step]
        if step in mirror and _verifies(mirror[step]):
            return _repair_from_mirror(mirror[step], checkpoint_path(root, step))
    return _from_archive(Path(root), archive) if archive is not None else None


def resolve_resume(mode: Literal["auto", "none"] | str | Path, root: Path, mirror_root: Path | None = None,
                   archive: ArchiveConfig | None = None) -> Path | None:
    """The checkpoint to resume from: ``none`` → ``None``; ``auto`` → ``find_latest_across``; otherwise
    ``mode`` is a checkpoint path, which must verify — or, failing that, the mirror's copy of the same
    step (logged as ``checkpoint_fallback_to_mirror``). With no mirror and no archive this behaves as
    ``learner.checkpoint.store.resolve_resume``.

    Raises:
        CheckpointError: an explicit path that does not verify and has no verifying mirror copy (the
            message names both copies' reasons).
    """
    if mode == "none":
        return None
    if mode == "auto":
        return find_latest_across(root, mirror_root, archive)
    path = Path(mode)
    try:
        verify(path)
        return path
    except CheckpointError as exc:  # recovery path: try the mirror's copy of this step
        if mirror_root is None or not _NAME.match(path.name):
            raise
        fallback = checkpoint_path(mirror_root, step_of(path.name))
        if fallback.resolve() == path.resolve():
            raise
        try:
            verify(fallback)
        except CheckpointError as mirror_exc:
            raise CheckpointError(f"{exc}; the mirror's copy does not verify either: {mirror_exc}") from exc
        log.warning("checkpoint_fallback_to_mirror", path=str(path), mirror=str(fallback), reason=str(exc))
        return fallback

