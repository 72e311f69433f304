"""Archive tier for learner checkpoints: any fsspec URL (``s3://bucket/prefix``, ``file:///…``, ``gs://…``).

Layout: ``{url}/global_step_{N}/{relpath}`` — the same relative paths as the local checkpoint
(``learner.checkpoint.store``), each object optionally AES-256-GCM encrypted (``learner.checkpoint.crypto``; the
manifest too). Protocol:

- upload (``archive_checkpoint``): a previous copy of the step loses its manifest first; every file is
  streamed up while its sha256 is checked against the local manifest; ``manifest.json`` goes up LAST, so
  an interrupted upload never looks complete (``list_archived`` only counts steps whose manifest exists).
- download (``fetch_checkpoint``): into ``{dest_root}/global_step_{N}.tmp-{pid}``, fsync'd, checked with
  ``learner.checkpoint.store.verify``, then renamed to ``global_step_{N}`` and ``dest_root`` fsync'd (the local
  commit protocol). A bad object raises ``CheckpointError`` naming the URL and the file; the temp dir is
  removed, so nothing unverified is ever left where resume looks.
- retention (``prune_archive``): keep the newest ``keep_last_n`` complete steps; a step loses its manifest
  before its other objects.

Fault point for crash tests: ``learner.archive.before_manifest`` (see ``faults``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import time
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import fsspec
import structlog
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gyre.learner.checkpoint import crypto
from gyre.faults import fault_point
from gyre.learner.checkpoint.store import (MANIFEST, CheckpointError, checkpoint_path, fsync_path, temp_path,
                                verify)

log = structlog.get_logger("learner.archive")
_STEP = re.compile(r"^global_step_(\d+)$")


class ArchiveConfig(BaseModel):
    """Where and how committed checkpoints are archived (one per learner)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    """fsspec URL of the archive root, e.g. ``s3://bucket/run-7/checkpoints`` or ``file:///mnt/archive``."""
    keep_last_n: int = Field(default=3, ge=1)
    """Complete archived checkpoints kept; older ones are deleted after each upload."""
    encrypt: bool = False
    """Encrypt every object with AES-256-GCM (``learner.checkpoint.crypto``); needs ``key_file`` or ``key_env``."""
    key_file: Path | None = None
    """File holding the 32-byte key, raw or as 64 hex characters. Never stored with the archive."""
    key_env: str | None = None
    """Name of an environment variable holding the key as 64 hex characters."""
    chunk_bytes: int = Field(default=crypto.DEFAULT_CHUNK_BYTES, ge=1, le=crypto.MAX_CHUNK_BYTES)
    """Plaintext bytes per encrypted chunk (bytes); a transfer holds about 3× this in memory."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """Passed to the fsspec filesystem (s3fs: ``endpoint_url``, ``key``, ``secret``, ``client_kwargs``…)."""

    @field_validator("url")
    @classmethod
    def _known_protocol(cls, url: str) -> str:
        protocol, path = fsspec.core.split_protocol(url)
        if not path.strip("/"):
            raise ValueError(f"url {url!r} has no path; expected e.g. 's3://bucket/prefix' or 'file:///dir'")
        if protocol is not None and protocol not in fsspec.available_protocols():
            raise ValueError(f"url {url!r}: fsspec knows no protocol {protocol!r}")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _key_source(self) -> ArchiveConfig:
        has_source = self.key_file is not None or self.key_env is not None
        if self.encrypt and not has_source:
            raise ValueError("encrypt=True needs a key source: set key_file (32 raw bytes or 64 hex characters) "
                             "or key_env (name of an environment variable holding 64 hex characters)")
        if has_source and not self.encrypt:
            raise ValueError(f"key_file ({self.key_file}) / key_env ({self.key_env!r}) is set but encrypt is False; "
                             "set encrypt=True or drop the key source")
        if self.encrypt:
            self.key()  # eager: a missing or malformed key fails at construction, naming the source
        return self

    def key(self) -> bytes | None:
        """The 32-byte AES key (``None`` without ``encrypt``), read fresh from its source each call.
        Raises ``ValueError`` naming the source and the length found."""
        return crypto.load_key(self.key_file, self.key_env) if self.encrypt else None


# ---- shared helpers (also used by learner.mirror) -------------------------------------------------
class HashingReader:
    """Wraps a binary reader; counts bytes and sha256s everything read through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.bytes, self._h = raw, 0, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.bytes += len(data)
        self._h.update(data)
        return data

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def manifest_files(manifest_bytes: bytes, where: str) -> dict[str, dict]:
    """``{relpath: {"bytes", "sha256"}}`` from a manifest's bytes; each relpath must stay inside the
    checkpoint (no absolute path, no ``..``). Raises ``CheckpointError`` naming ``where``."""
    try:
        files = json.loads(manifest_bytes)["files"]
        entries = {str(k): {"bytes": int(v["bytes"]), "sha256": str(v["sha256"])} for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {where}: {MANIFEST} is unreadable: {exc}") from exc
    for name in entries:
        p = PurePosixPath(name)
        if p.is_absolute() or ".." in p.parts or not p.parts or name == MANIFEST:
            raise CheckpointError(f"checkpoint {where}: {MANIFEST} lists a bad path {name!r} "
                                  "(expected a relative path inside the checkpoint)")
    return entries


def check_copied(reader: HashingReader, want: dict, name: str, where: str) -> None:
    """Raise ``CheckpointError`` naming ``where``/``name`` if what went through ``reader`` differs from
    the manifest entry ``want`` (size first, then sha256)."""
    if reader.bytes != want["bytes"]:
        raise CheckpointError(f"checkpoint {where}: {name} has {reader.bytes} bytes; manifest says "
                              f"{want['bytes']} (truncated?)")
    if reader.hexdigest() != want["sha256"]:
        raise CheckpointError(f"checkpoint {where}: {name} sha256 does not match the manifest (corrupt)")


def step_of(name: str) -> int:
    """N from a ``global_step_N`` name (last path component). Raises ``ValueError`` otherwise."""
    m = _STEP.match(PurePosixPath(str(name).rstrip("/")).name)
    if m is None:
        raise ValueError(f"{name!r} is not a checkpoint name; expected 'global_step_<N>'")
    return int(m.group(1))


def _fs(cfg: ArchiveConfig) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = fsspec.core.url_to_fs(cfg.url, **cfg.storage_options)
    return fs, root.rstrip("/")


def _url(cfg: ArchiveConfig, step: int, name: str = "") -> str:
    return f"{cfg.url}/global_step_{step}" + (f"/{name}" if name else "")


# ---- upload --------------------------------------------------------------------------------------
def _put(fs, src: BinaryIO, remote: str, relpath: str, key: bytes | None, chunk_bytes: int) -> None:
    with fs.open(remote, "wb") as dst:
        if key is None:
            shutil.copyfileobj(src, dst, 1 << 20)
        else:
            crypto.encrypt_stream(src, dst, key, relpath, chunk_bytes)


def archive_checkpoint(path: Path, cfg: ArchiveConfig) -> str:
    """Upload the committed checkpoint at ``path`` (``…/global_step_N``) to ``{cfg.url}/global_step_N``,
    manifest last, then apply ``cfg.keep_last_n``. Returns the archived checkpoint's URL.

    Raises:
        CheckpointError: ``path`` has no readable manifest, or a local file differs from it (the partial
            upload is deleted).
        ValueError: ``path`` is not named ``global_step_N``.
    """
    path, t0 = Path(path), time.monotonic()
    step = step_of(path.name)
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is missing (not committed?)")
    manifest_bytes = (path / MANIFEST).read_bytes()
    files, key = manifest_files(manifest_bytes, str(path)), cfg.key()
    fs, root = _fs(cfg)
    remote = f"{root}/global_step_{step}"
    if fs.exists(f"{remote}/{MANIFEST}"):
        fs.rm(f"{remote}/{MANIFEST}")  # the old copy stops looking complete before it is overwritten
    for d in sorted({str(PurePosixPath(f"{remote}/{name}").parent) for name in files}):
        fs.makedirs(d, exist_ok=True)
    try:
        for name, want in sorted(files.items()):
            with open(path / name, "rb") as raw:
                reader = HashingReader(raw)
                _put(fs, reader, f"{remote}/{name}", name, key, cfg.chunk_bytes)
            check_copied(reader, want, name, str(path))
    except BaseException:  # cleanup path: a partial upload without manifest is removed, then re-raised
        fs.rm(remote, recursive=True)
        raise
    fault_point("learner.archive.before_manifest")
    _put(fs, io.BytesIO(manifest_bytes), f"{remote}/{MANIFEST}", MANIFEST, key, cfg.chunk_bytes)
    total = sum(w["bytes"] for w in files.values()) + len(manifest_bytes)
    log.info("checkpoint_archived", url=_url(cfg, step), files=len(files) + 1, bytes=total,
             encrypted=cfg.encrypt, seconds=round(time.monotonic() - t0, 3))
    prune_archive(cfg)
    return _url(cfg, step)


# ---- listing and retention -----------------------------------------------------------------------
def _archived_dirs(fs, root: str) -> dict[int, str]:
    fs.invalidate_cache(root)  # another process may have uploaded since this filesystem last listed
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return {}
    found = {}
    for entry in entries:
        m = _STEP.match(PurePosixPath(entry.rstrip("/")).name)
        if m:
            found[int(m.group(1))] = entry.rstrip("/")
    return found


def list_archived(cfg: ArchiveConfig) -> list[int]:
    """Steps archived under ``cfg.url`` whose manifest exists (complete uploads), ascending."""
    fs, root = _fs(cfg)
    return sorted(s for s, d in _archived_dirs(fs, root).items() if fs.exists(f"{d}/{MANIFEST}"))


def prune_archive(cfg: ArchiveConfig) -> list[int]:
    """Delete all but the newest ``cfg.keep_last_n`` complete archived checkpoints, and incomplete ones
    older than the oldest kept (dead uploads; newer incomplete ones may be uploads in flight).
    Each loses its manifest first. Returns the deleted steps, ascending."""
    fs, root = _fs(cfg)
    dirs = _archived_dirs(fs, root)
    complete = sorted(s for s, d in dirs.items() if fs.exists(f"{d}/{MANIFEST}"))
    kept = complete[-cfg.keep_last_n:]
    doomed = [s for s in sorted(dirs) if s not in kept and (not kept or s < kept[0] or s in complete)]
    for s in doomed:
        if s in complete:
            fs.rm(f"{dirs[s]}/{MANIFEST}")
        fs.rm(dirs[s], recursive=True)
    if doomed:
        log.info("archive_pruned", url=cfg.url, removed=doomed, kept=kept)
    return doomed


# ---- download ------------------------------------------------------------------------------------
def _get(fs, remote: str, dst: BinaryIO, relpath: str, key: bytes | None) -> None:
    with fs.open(remote, "rb") as src:
        if key is None:
            head = src.read(len(crypto.MAGIC))
            if head == crypto.MAGIC:
                raise CheckpointError(f"{relpath} is encrypted (gyre AES-256-GCM header) but encrypt is False")
            dst.write(head)
            shutil.copyfileobj(src, dst, 1 << 20)
        else:
            crypto.decrypt_stream(src, dst, key, relpath)


def _download(fs, remote: str, tmp: Path, key: bytes | None, url: str) -> None:
    """All objects of one archived checkpoint into ``tmp`` (manifest last), fsync'd."""
    buf = io.BytesIO()
    try:
        _get(fs, f"{remote}/{MANIFEST}", buf, MANIFEST, key)
    except FileNotFoundError:
        raise CheckpointError(f"{MANIFEST} is missing (incomplete upload?)") from None
    files = manifest_files(buf.getvalue(), url)
    for name in sorted(files):
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp / name, "wb") as dst:
                _get(fs, f"{remote}/{name}", dst, name, key)
                dst.flush()
                os.fsync(dst.fileno())
        except FileNotFoundError:
            raise CheckpointError(f"{name} is missing") from None
    with open(tmp / MANIFEST, "wb") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())
    for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [tmp]:
        fsync_path(d)


def fetch_checkpoint(url_or_step: str | int, dest_root: Path, cfg: ArchiveConfig) -> Path:
    """Download an archived checkpoint (a step number, a ``global_step_N`` name under ``cfg.url``, or a
    ``…/global_step_N`` URL on ``cfg``'s filesystem), decrypt and verify it, and commit it as ``{dest_root}/global_step_N`` (replacing an
    existing one). Returns that path.

    Raises:
        CheckpointError: no manifest (incomplete upload), a missing object, "authentication failed"
            (wrong key / tampered object), or a file that does not match the manifest — naming the URL
            and the file. ``dest_root`` is left without any new directory.
    """
    t0 = time.monotonic()
    step = url_or_step if isinstance(url_or_step, int) else step_of(str(url_or_step))
    fs, root = _fs(cfg)
    by_step = isinstance(url_or_step, int) or "/" not in str(url_or_step)
    remote = f"{root}/global_step_{step}" if by_step else fs._strip_protocol(str(url_or_step)).rstrip("/")
    url = _url(cfg, step) if by_step else str(url_or_step).rstrip("/")
    fs.invalidate_cache(remote)
    dest_root = Path(dest_root)
    tmp, final = temp_path(dest_root, step), checkpoint_path(dest_root, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        try:
            _download(fs, remote, tmp, cfg.key(), url)
            verify(tmp)
        except CheckpointError as exc:
            reason = str(exc).replace(f"checkpoint {tmp}: ", "").replace(f"checkpoint {url}: ", "")
            raise CheckpointError(f"archived checkpoint {url}: {reason}") from exc
        rename_into_place(tmp, final)
    except BaseException:  # cleanup path: nothing unverified stays in dest_root
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("checkpoint_fetched", url=url, path=str(final), seconds=round(time.monotonic() - t0, 3))
    return final


def rename_into_place(tmp: Path, final: Path) -> None:
    """Atomic rename of a complete temp dir to ``final`` (an existing ``final`` moved aside, then
    removed), then fsync the parent — the last steps of ``learner.checkpoint.store.commit``."""
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
