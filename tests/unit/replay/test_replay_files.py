"""Snapshot file plumbing: the natively written, trailing-hashed file and the background runner."""

import hashlib
import os
import threading

import numpy as np
import pyarrow as pa
import pytest

from gyre.replay.files import HashingFile, read_verified, run_in_background
from gyre.replay.types import SnapshotError


def test_hashing_file_hashes_exactly_what_arrow_wrote(tmp_path):
    table = pa.table({"x": np.arange(3_000_000, dtype=np.int64)})  # 24 MB: several 8 MiB ranges plus a tail
    sink = HashingFile(tmp_path / "t.arrow")
    with pa.ipc.new_file(sink.sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=100_000):
            writer.write_batch(batch)
            sink.written()
    sink.close()
    data = (tmp_path / "t.arrow").read_bytes()
    assert sink.size == len(data) > 24_000_000
    assert sink.sha.hexdigest() == hashlib.sha256(data).hexdigest()
    buf = read_verified(tmp_path, "t.arrow", {"bytes": sink.size, "sha256": sink.sha.hexdigest()})
    assert pa.ipc.open_file(buf).read_all().equals(table)


def test_read_verified_names_the_file_on_a_flipped_byte(tmp_path):
    (tmp_path / "f.bin").write_bytes(b"abcdef")
    want = {"bytes": 6, "sha256": hashlib.sha256(b"abcdef").hexdigest()}
    assert read_verified(tmp_path, "f.bin", want).to_pybytes() == b"abcdef"
    (tmp_path / "f.bin").write_bytes(b"abcdeX")
    with pytest.raises(SnapshotError, match="f.bin sha256 .* does not match the manifest"):
        read_verified(tmp_path, "f.bin", want)
    with pytest.raises(SnapshotError, match="f.bin has 6 bytes; manifest says 7"):
        read_verified(tmp_path, "f.bin", {**want, "bytes": 7})


def test_hashing_file_refuses_an_existing_path(tmp_path):
    (tmp_path / "x").write_bytes(b"")
    with pytest.raises(FileExistsError):
        HashingFile(tmp_path / "x")


def test_run_in_background_returns_raises_and_leaves_the_caller_priority(tmp_path):
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ran_on = []

    def work(x):
        ran_on.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return x * 2

    assert run_in_background(work, 21) == 42
    (name, niceness), = ran_on
    assert name == "replay-snapshot-writer" and (niceness == 10 or before > 10)  # lowered, never raised
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before

    def fail():
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left on device"):
        run_in_background(fail)
