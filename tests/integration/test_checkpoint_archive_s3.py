"""learner.archive against a real S3-compatible server on loopback (moto's threaded server, port 0) with
s3fs as the fsspec backend: plain and AES-256-GCM encrypted round trips, corruption, wrong key,
truncation, swapped objects, interrupted uploads, retention, and resume falling back to the archive."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer
from structlog.testing import capture_logs

from gyre.learner.checkpoint import store as ckpt
from gyre.learner.checkpoint.archive import ArchiveConfig, archive_checkpoint, fetch_checkpoint, list_archived
from gyre.learner.checkpoint.mirror import resolve_resume

REPO = Path(__file__).resolve().parents[2]
FILES = ("deepspeed/zero/model.pt", "deepspeed/optim.pt", "rng_rank0.json", "metadata.json")


@pytest.fixture(scope="module")
def endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(endpoint):
    """(boto3 client, bucket): a fresh bucket per test."""
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    bucket = f"gyre-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return client, bucket


def config(endpoint: str, bucket: str, **kw) -> ArchiveConfig:
    opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}}
    return ArchiveConfig(url=f"s3://{bucket}/run-1/checkpoints", storage_options=opts, **kw)


def save(root: Path, step: int) -> Path:
    """A committed checkpoint with a 200 KiB 'model' (several 64 KiB encryption chunks) and a few small files."""
    tmp = ckpt.temp_path(root, step)
    (tmp / "deepspeed" / "zero").mkdir(parents=True)
    (tmp / "deepspeed" / "zero" / "model.pt").write_bytes(bytes((i * 7 + step) % 251 for i in range(200 * 1024)))
    (tmp / "deepspeed" / "optim.pt").write_bytes(b"adam-moments" * 10 + bytes([step]))
    (tmp / "rng_rank0.json").write_text(f'{{"step": {step}}}')
    return ckpt.commit(tmp, ckpt.checkpoint_path(root, step), ckpt.CheckpointMetadata(step=step, policy_version=step))


def tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def key_of(step: int, name: str) -> str:
    return f"run-1/checkpoints/global_step_{step}/{name}"


def get(s3, step: int, name: str) -> bytes:
    client, bucket = s3
    return client.get_object(Bucket=bucket, Key=key_of(step, name))["Body"].read()


def put(s3, step: int, name: str, data: bytes) -> None:
    client, bucket = s3
    client.put_object(Bucket=bucket, Key=key_of(step, name), Body=data)


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "archive.key"
    path.write_text("5a" * 32)
    return path


def test_plain_roundtrip_is_byte_equal_and_a_flipped_object_is_refused_by_name(tmp_path, endpoint, s3):
    cfg = config(endpoint, s3[1], keep_last_n=2)
    src = save(tmp_path / "ckpt", 4)
    assert archive_checkpoint(src, cfg) == f"s3://{s3[1]}/run-1/checkpoints/global_step_4"
    assert list_archived(cfg) == [4]
    assert get(s3, 4, "deepspeed/zero/model.pt") == (src / "deepspeed/zero/model.pt").read_bytes()
    got = fetch_checkpoint(4, tmp_path / "restore", cfg)
    assert got == tmp_path / "restore" / "global_step_4" and tree(got) == tree(src)
    assert ckpt.verify(got).step == 4
    assert tree(fetch_checkpoint(f"{cfg.url}/global_step_4/", tmp_path / "by-url", cfg)) == tree(src)
    assert tree(fetch_checkpoint("global_step_4", tmp_path / "by-name", cfg)) == tree(src)

    data = bytearray(get(s3, 4, "deepspeed/optim.pt"))
    data[5] ^= 0x01
    put(s3, 4, "deepspeed/optim.pt", bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"archived checkpoint s3://.*/global_step_4: deepspeed/optim.pt "
                                                    r"sha256 does not match the manifest"):
        fetch_checkpoint(4, tmp_path / "bad", cfg)
    assert list((tmp_path / "bad").iterdir()) == []


def test_interrupted_upload_is_not_listed_and_retention_keeps_last_n(tmp_path, endpoint, s3):
    cfg = config(endpoint, s3[1], keep_last_n=2)
    for step in (1, 2, 3):
        archive_checkpoint(save(tmp_path / "ckpt", step), cfg)
    client, bucket = s3
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == sorted(key_of(s, f) for s in (2, 3) for f in (*FILES, "manifest.json"))
    client.delete_object(Bucket=bucket, Key=key_of(3, "manifest.json"))  # as if the upload died before it
    assert list_archived(cfg) == [2]
    with pytest.raises(ckpt.CheckpointError, match="global_step_3: manifest.json is missing"):
        fetch_checkpoint(3, tmp_path / "restore", cfg)


def test_a_process_killed_before_the_manifest_upload_leaves_an_archive_that_does_not_look_complete(
        tmp_path, endpoint, s3, key_file):
    cfg = config(endpoint, s3[1], encrypt=True, key_file=key_file)
    src = save(tmp_path / "ckpt", 5)
    code = ("import sys; from gyre.learner.checkpoint.archive import ArchiveConfig, archive_checkpoint; "
            "archive_checkpoint(sys.argv[1], ArchiveConfig.model_validate_json(sys.argv[2]))")
    env = {**os.environ, "GYRE_FAULT_POINT": "learner.archive.before_manifest"}
    proc = subprocess.run([sys.executable, "-c", code, str(src), cfg.model_dump_json()], cwd=REPO, env=env,
                          capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    client, bucket = s3
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == sorted(key_of(5, f) for f in FILES)
    assert list_archived(cfg) == []
    with pytest.raises(ckpt.CheckpointError, match="global_step_5: manifest.json is missing"):
        fetch_checkpoint(5, tmp_path / "restore", cfg)
    archive_checkpoint(src, cfg)  # the retry completes it
    assert list_archived(cfg) == [5] and tree(fetch_checkpoint(5, tmp_path / "restore", cfg)) == tree(src)


def test_encrypted_roundtrip_stores_no_plaintext_and_no_key(tmp_path, endpoint, s3, key_file):
    cfg = config(endpoint, s3[1], keep_last_n=2, encrypt=True, key_file=key_file, chunk_bytes=64 * 1024)
    src = save(tmp_path / "ckpt", 9)
    archive_checkpoint(src, cfg)
    for name in (*FILES, "manifest.json"):
        stored, plain = get(s3, 9, name), (src / name).read_bytes()
        chunks = max(1, -(-len(plain) // (64 * 1024)))
        assert len(stored) == 12 + len(plain) + 28 * chunks and stored[:8] == b"GYREAE1\0"
        assert plain[:32] not in stored
    client, bucket = s3
    everything = b"".join(get(s3, 9, n) for n in (*FILES, "manifest.json"))
    assert b"5a" * 32 not in everything and bytes.fromhex("5a" * 32) not in everything
    assert len(client.list_objects_v2(Bucket=bucket)["Contents"]) == len(FILES) + 1
    got = fetch_checkpoint(9, tmp_path / "restore", cfg)
    assert tree(got) == tree(src)


@pytest.mark.parametrize("damage, match", [
    ("wrong_key", r"global_step_9: manifest.json: authentication failed at chunk 0"),
    ("tampered_byte", r"global_step_9: deepspeed/zero/model.pt: authentication failed at chunk 2"),
    ("truncated_object", r"global_step_9: deepspeed/zero/model.pt: authentication failed at chunk 2"),
    ("swapped_files", r"global_step_9: deepspeed/optim.pt: authentication failed at chunk 0"),
    ("read_as_plain", r"global_step_9: manifest.json is encrypted \(gyre AES-256-GCM header\) but encrypt is False"),
])
def test_encrypted_objects_that_do_not_authenticate_are_refused_by_name(tmp_path, endpoint, s3, key_file,
                                                                       damage, match):
    cfg = config(endpoint, s3[1], encrypt=True, key_file=key_file, chunk_bytes=64 * 1024)
    archive_checkpoint(save(tmp_path / "ckpt", 9), cfg)
    model, optim = get(s3, 9, "deepspeed/zero/model.pt"), get(s3, 9, "deepspeed/optim.pt")
    if damage == "wrong_key":
        other = tmp_path / "other.key"
        other.write_bytes(b"\x01" * 32)
        cfg = cfg.model_copy(update={"key_file": other})
    elif damage == "tampered_byte":
        put(s3, 9, "deepspeed/zero/model.pt", model[:150_000] + bytes([model[150_000] ^ 1]) + model[150_001:])
    elif damage == "truncated_object":  # drop the last chunk whole: the new last chunk was sealed non-final
        put(s3, 9, "deepspeed/zero/model.pt", model[:12 + 3 * (64 * 1024 + 28)])
    elif damage == "swapped_files":
        put(s3, 9, "deepspeed/zero/model.pt", optim)
        put(s3, 9, "deepspeed/optim.pt", model)
    elif damage == "read_as_plain":
        cfg = config(endpoint, s3[1])
    dest = tmp_path / "restore"
    with pytest.raises(ckpt.CheckpointError, match=match):
        fetch_checkpoint(9, dest, cfg)
    assert list(dest.iterdir()) == []  # no plaintext, partial or garbage left where resume looks


def test_resume_auto_falls_back_to_the_newest_archived_checkpoint(tmp_path, endpoint, s3, key_file):
    cfg = config(endpoint, s3[1], keep_last_n=3, encrypt=True, key_file=key_file)
    root, mirror = tmp_path / "ckpt", tmp_path / "mirror"
    for step in (1, 2):
        archive_checkpoint(save(root, step), cfg)
    expected = tree(root / "global_step_2")
    (root / "global_step_2" / "deepspeed/optim.pt").write_bytes(b"torn")
    (root / "global_step_1" / "manifest.json").unlink()
    with capture_logs() as logs:
        assert resolve_resume("auto", root, mirror, archive=cfg) == root / "global_step_2"
    assert tree(root / "global_step_2") == expected
    assert [e["event"] for e in logs if e["log_level"] in ("warning", "error")] == [
        "checkpoint_skipped", "checkpoint_skipped", "resume_from_archive"]
