"""learner.mirror (double-written checkpoints, resume across tiers), learner.archive over file://,
ArchiveConfig validation and the learner.crypto chunk format. No DeepSpeed: checkpoints are a few files
committed with the real ``learner.checkpoint.store.commit``."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs

from gyre.learner.checkpoint import store as ckpt
from gyre.learner.checkpoint import crypto
from gyre.learner.checkpoint.archive import ArchiveConfig, archive_checkpoint, fetch_checkpoint, list_archived, prune_archive
from gyre.learner.checkpoint.mirror import CheckpointTiersConfig, copy_commit, mirror_checkpoint, resolve_resume

REPO = Path(__file__).resolve().parents[3]


def save(root: Path, step: int, payload: bytes = b"weights") -> Path:
    """A committed checkpoint: a nested 'DeepSpeed' file, an RNG file, metadata, manifest."""
    tmp = ckpt.temp_path(root, step)
    (tmp / "deepspeed" / "zero").mkdir(parents=True)
    (tmp / "deepspeed" / "zero" / "model.pt").write_bytes(payload * 100 + bytes([step % 256]))
    (tmp / "rng_rank0.json").write_text(f'{{"step": {step}}}')
    return ckpt.commit(tmp, ckpt.checkpoint_path(root, step), ckpt.CheckpointMetadata(step=step, policy_version=step))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def roots(tmp_path):
    return tmp_path / "ckpt", tmp_path / "mirror"


# ---- mirror --------------------------------------------------------------------------------------
def test_mirror_copies_byte_identical_and_prunes_to_keep_last_n(roots):
    root, mirror = roots
    for step in (1, 2, 3):
        copy = mirror_checkpoint(save(root, step), mirror, keep_last_n=2)
        assert copy == mirror / f"global_step_{step}"
        assert tree(copy) == tree(root / f"global_step_{step}")
    assert sorted(p.name for p in mirror.iterdir()) == ["global_step_2", "global_step_3"]
    assert ckpt.verify(mirror / "global_step_3").step == 3
    with pytest.raises(ValueError, match=r"keep_last_n \(0\)"):
        mirror_checkpoint(root / "global_step_3", mirror, keep_last_n=0)
    with pytest.raises(ValueError, match="is the checkpoint's own directory"):
        mirror_checkpoint(root / "global_step_3", root, keep_last_n=2)


def test_mirror_refuses_a_primary_that_went_bad_and_leaves_no_dir(roots):
    root, mirror = roots
    flip_byte(save(root, 5) / "deepspeed" / "zero" / "model.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"deepspeed/zero/model.pt sha256 does not match"):
        mirror_checkpoint(root / "global_step_5", mirror, keep_last_n=2)
    assert list(mirror.iterdir()) == []


def test_a_crash_before_the_mirror_rename_leaves_only_an_ignored_temp_dir(roots):
    root, mirror = roots
    save(root, 7)
    code = (f"from gyre.learner.checkpoint.mirror import mirror_checkpoint; "
            f"mirror_checkpoint({str(root / 'global_step_7')!r}, {str(mirror)!r}, 2)")
    env = {**os.environ, "GYRE_FAULT_POINT": "learner.mirror.before_rename"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    (left,) = mirror.iterdir()
    assert left.name.startswith("global_step_7.tmp-") and (left / "manifest.json").is_file()
    assert ckpt.list_checkpoints(mirror) == []
    flip_byte(root / "global_step_7" / "metadata.json")
    with capture_logs() as logs:
        assert resolve_resume("auto", root, mirror) is None
    assert [e["path"] for e in logs if e["event"] == "checkpoint_skipped"] == [str(root / "global_step_7")]
    mirror_checkpoint(save(root, 8), mirror, keep_last_n=2)  # the dead temp dir is pruned
    assert sorted(p.name for p in mirror.iterdir()) == ["global_step_8"]


# ---- resume across primary and mirror ------------------------------------------------------------
def test_auto_takes_the_mirror_copy_of_a_corrupt_primary_and_repairs_the_primary(roots):
    root, mirror = roots
    for step in (1, 2):
        mirror_checkpoint(save(root, step), mirror, keep_last_n=3)
    good = tree(root / "global_step_2")
    flip_byte(root / "global_step_2" / "deepspeed" / "zero" / "model.pt")
    with capture_logs() as logs:
        assert resolve_resume("auto", root, mirror) == root / "global_step_2"
    skipped, repaired = [e for e in logs if e["event"] in ("checkpoint_skipped", "checkpoint_repaired_from_mirror")]
    assert skipped["path"] == str(root / "global_step_2") and "model.pt sha256 does not match" in skipped["reason"]
    assert (repaired["log_level"], repaired["mirror"]) == ("warning", str(mirror / "global_step_2"))
    assert tree(root / "global_step_2") == good and ckpt.verify(root / "global_step_2").step == 2


def test_auto_restores_a_lost_primary_dir_from_the_mirror(roots):
    root, mirror = roots
    mirror_checkpoint(save(root, 4), mirror, keep_last_n=3)
    good = tree(root / "global_step_4")
    shutil.rmtree(root)
    assert resolve_resume("auto", root, mirror) == root / "global_step_4"
    assert tree(root / "global_step_4") == good


def test_auto_prefers_the_primary_at_equal_step_and_the_newest_step_overall(roots):
    root, mirror = roots
    for step in (1, 2):
        mirror_checkpoint(save(root, step), mirror, keep_last_n=3)
    with capture_logs() as logs:
        assert resolve_resume("auto", root, mirror) == root / "global_step_2"
    assert logs == []
    save(root, 3)  # not mirrored yet
    assert resolve_resume("auto", root, mirror) == root / "global_step_3"
    mirror_checkpoint(save(root, 4), mirror, keep_last_n=3)
    flip_byte(mirror / "global_step_4" / "rng_rank0.json")
    (root / "global_step_4" / "manifest.json").unlink()
    with capture_logs() as logs:
        assert resolve_resume("auto", root, mirror) == root / "global_step_3"
    assert [e["path"] for e in logs if e["event"] == "checkpoint_skipped"] == [
        str(root / "global_step_4"), str(mirror / "global_step_4")]


def test_explicit_path_falls_back_to_the_mirror_copy_of_the_same_step(roots):
    root, mirror = roots
    mirror_checkpoint(save(root, 6), mirror, keep_last_n=3)
    assert resolve_resume(str(root / "global_step_6"), root, mirror) == root / "global_step_6"
    flip_byte(root / "global_step_6" / "metadata.json")
    with capture_logs() as logs:
        assert resolve_resume(str(root / "global_step_6"), root, mirror) == mirror / "global_step_6"
    (event,) = logs
    assert event["event"] == "checkpoint_fallback_to_mirror" and "metadata.json sha256" in event["reason"]
    flip_byte(mirror / "global_step_6" / "deepspeed" / "zero" / "model.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"metadata.json sha256 .*; the mirror's copy does not verify "
                                                    r"either: .*deepspeed/zero/model.pt sha256"):
        resolve_resume(root / "global_step_6", root, mirror)
    with pytest.raises(ckpt.CheckpointError, match="metadata.json sha256 does not match"):
        resolve_resume(root / "global_step_6", root)
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint {root / 'nope'} does not exist"):
        resolve_resume(root / "nope", root, mirror)
    assert resolve_resume("none", root, mirror) is None
    assert resolve_resume("auto", root / "absent", root / "absent2") is None


def test_copy_commit_replaces_an_existing_copy(roots):
    root, mirror = roots
    mirror_checkpoint(save(root, 1, payload=b"a"), mirror, keep_last_n=2)
    copy_commit(save(root, 1, payload=b"b"), mirror / "global_step_1")
    assert tree(mirror / "global_step_1") == tree(root / "global_step_1")
    assert sorted(p.name for p in mirror.iterdir()) == ["global_step_1"]


# ---- archive over file:// ------------------------------------------------------------------------
def test_file_archive_roundtrip_retention_and_resume_fallback(tmp_path, roots):
    root, mirror = roots
    cfg = ArchiveConfig(url=f"file://{tmp_path / 'archive'}", keep_last_n=2)
    for step in (1, 2, 3):
        assert archive_checkpoint(save(root, step), cfg) == f"{cfg.url}/global_step_{step}"
    assert list_archived(cfg) == [2, 3]
    (tmp_path / "archive" / "global_step_3" / "manifest.json").unlink()  # looks like an interrupted upload
    assert list_archived(cfg) == [2]
    expected = tree(root / "global_step_2")
    for path in ckpt.list_checkpoints(root):
        flip_byte(path / "metadata.json")
    with capture_logs() as logs:
        assert resolve_resume("auto", root, mirror, archive=cfg) == root / "global_step_2"
    assert tree(root / "global_step_2") == expected
    (loud,) = [e for e in logs if e["event"] == "resume_from_archive"]
    assert loud["log_level"] == "error" and loud["url"] == f"{cfg.url}/global_step_2"
    assert [e["path"] for e in logs if e["event"] == "checkpoint_skipped"] == [
        str(root / f"global_step_{s}") for s in (3, 2, 1)]
    with pytest.raises(ckpt.CheckpointError, match="global_step_3: manifest.json is missing"):
        fetch_checkpoint(3, tmp_path / "dest", cfg)
    assert not (tmp_path / "dest").exists() or list((tmp_path / "dest").iterdir()) == []
    assert prune_archive(cfg.model_copy(update={"keep_last_n": 1})) == []  # 3 is newer than the kept 2: in flight?


# ---- config validation ---------------------------------------------------------------------------
def test_archive_config_validation_names_the_field(tmp_path, monkeypatch):
    with pytest.raises(ValidationError, match="encrypt=True needs a key source: set key_file"):
        ArchiveConfig(url="s3://b/p", encrypt=True)
    short = tmp_path / "short.key"
    short.write_bytes(b"k" * 31)
    with pytest.raises(ValidationError, match=f"key_file {short}: key is 31 bytes"):
        ArchiveConfig(url="s3://b/p", encrypt=True, key_file=short)
    with pytest.raises(ValidationError, match=r"key_env: environment variable 'GYRE_TEST_KEY' is not set"):
        ArchiveConfig(url="s3://b/p", encrypt=True, key_env="GYRE_TEST_KEY")
    monkeypatch.setenv("GYRE_TEST_KEY", "ab" * 31)
    with pytest.raises(ValidationError, match=r"key_env \$GYRE_TEST_KEY: key is 62 bytes"):
        ArchiveConfig(url="s3://b/p", encrypt=True, key_env="GYRE_TEST_KEY")
    monkeypatch.setenv("GYRE_TEST_KEY", "ab" * 32)
    assert ArchiveConfig(url="s3://b/p", encrypt=True, key_env="GYRE_TEST_KEY").key() == b"\xab" * 32
    hex_file = tmp_path / "hex.key"
    hex_file.write_text("cd" * 32 + "\n")
    assert ArchiveConfig(url="s3://b/p", encrypt=True, key_file=hex_file).key() == b"\xcd" * 32
    with pytest.raises(ValidationError, match="is set but encrypt is False"):
        ArchiveConfig(url="s3://b/p", key_file=hex_file)
    with pytest.raises(ValidationError, match="exactly one of key_file"):
        ArchiveConfig(url="s3://b/p", encrypt=True, key_file=hex_file, key_env="GYRE_TEST_KEY")
    with pytest.raises(ValidationError, match="fsspec knows no protocol 'nosuchfs'"):
        ArchiveConfig(url="nosuchfs://b/p")
    with pytest.raises(ValidationError, match="keep_last_n"):
        ArchiveConfig(url="s3://b/p", keep_last_n=0)
    with pytest.raises(ValidationError, match="bucket"):
        ArchiveConfig(url="s3://b/p", bucket="x")
    with pytest.raises(ValidationError, match="mirror_dr"):
        CheckpointTiersConfig(mirror_dr=tmp_path)


# ---- crypto chunk format -------------------------------------------------------------------------
KEY = bytes(range(32))


def seal(data: bytes, relpath: str = "deepspeed/model.pt", chunk: int = 16) -> bytes:
    out = io.BytesIO()
    assert crypto.encrypt_stream(io.BytesIO(data), out, KEY, relpath, chunk) == len(data)
    return out.getvalue()


def unseal(blob: bytes, relpath: str = "deepspeed/model.pt", key: bytes = KEY) -> bytes:
    out = io.BytesIO()
    crypto.decrypt_stream(io.BytesIO(blob), out, key, relpath)
    return out.getvalue()


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 48, 50])
def test_chunked_aes_gcm_roundtrip_and_overhead(size):
    data = os.urandom(size)
    blob = seal(data)
    chunks = max(1, -(-size // 16))
    assert len(blob) == crypto.HEADER_BYTES + size + chunks * (crypto.NONCE_BYTES + crypto.TAG_BYTES)
    assert unseal(blob) == data and (size < 8 or data not in blob)


def test_chunk_truncation_reordering_and_swapping_fail_authentication():
    data = os.urandom(48)  # three full 16-byte chunks
    blob, sealed = seal(data), 16 + crypto.NONCE_BYTES + crypto.TAG_BYTES
    h = crypto.HEADER_BYTES
    chunks = [blob[h + i * sealed:h + (i + 1) * sealed] for i in range(3)]
    cases = {
        "cut at a chunk boundary": (blob[:h + 2 * sealed], "chunk 1"),
        "chunks reordered": (blob[:h] + chunks[1] + chunks[0] + chunks[2], "chunk 0"),
        "cut inside a chunk": (blob[:-5], "chunk 2"),
        "header chunk size changed": (blob[:h - 1] + b"\x11" + blob[h:], "chunk 0"),
    }
    for case, (bad, where) in cases.items():
        with pytest.raises(ckpt.CheckpointError, match=f"deepspeed/model.pt: authentication failed at {where}"):
            unseal(bad)
    with pytest.raises(ckpt.CheckpointError, match="rng_rank0.json: authentication failed at chunk 0"):
        unseal(blob, relpath="rng_rank0.json")
    with pytest.raises(ckpt.CheckpointError, match="authentication failed at chunk 0"):
        unseal(blob, key=bytes(32))
    with pytest.raises(ckpt.CheckpointError, match="not an encrypted gyre object"):
        unseal(data)
