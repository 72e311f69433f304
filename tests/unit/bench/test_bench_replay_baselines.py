"""``bench.replay_baselines``: the servers ``bench.replay``'s ingest ceilings are measured against do
what their names say (a ceiling that skipped its work would make the ratios against it meaningless)."""

import os
import threading

import pytest

from bench.replay_baselines import KINDS, LOGGING, RAW_METHOD, GroupCommitLog, baseline_server
from bench.replay_parts import requests, stream


def test_group_commit_log_returns_each_append_only_once_its_bytes_are_fsynced(tmp_path, monkeypatch):
    log = GroupCommitLog(tmp_path / "log")
    fsyncs, real_fsync = [], os.fsync

    def counted_fsync(fd):
        fsyncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counted_fsync)
    chunks = [bytes([i]) * (1000 + i) for i in range(40)]
    late = []

    def append(part):
        for chunk in part:
            end = log.append(chunk)
            if log.synced < end:
                late.append(chunk[0])

    threads = [threading.Thread(target=append, args=(chunks[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    data = (tmp_path / "log").read_bytes()
    assert log.written == log.synced == len(data) == sum(map(len, chunks))
    assert sorted(data) == sorted(b"".join(chunks))  # every byte of every append, each once
    assert all(chunk in data for chunk in chunks)  # each append's bytes in one piece
    assert not late
    assert 1 <= len(fsyncs) <= len(chunks)


def test_group_commit_log_without_fsync_never_fsyncs(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: pytest.fail("fsync called"))
    log = GroupCommitLog(tmp_path / "log", fsync=False)
    log.append(b"abc")
    log.close()
    assert (tmp_path / "log").read_bytes() == b"abc" and log.synced == 0


@pytest.mark.parametrize("kind", KINDS)
def test_each_baseline_answers_every_message_and_keeps_logs_and_fsyncs_as_named(kind, tmp_path, monkeypatch):
    fsyncs, real_fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd)))
    server, port, kept = baseline_server(kind, 0, tmp_path)
    try:
        reqs = list(requests(0, 3, 1, seed=0))
        sent = stream(f"127.0.0.1:{port}", iter(reqs), RAW_METHOD)
    finally:
        server.stop(grace=None)
    payloads = [r.arrow_ipc for r in reqs]
    assert sent == sum(map(len, payloads))
    assert kept == ([] if kind == "raw" else payloads)
    assert (tmp_path / "log").exists() == (kind in LOGGING)
    if kind in LOGGING:
        assert (tmp_path / "log").read_bytes() == b"".join(payloads)
    assert bool(fsyncs) == (kind == "durable")


def test_an_unknown_baseline_or_a_logging_one_without_a_directory_is_refused():
    with pytest.raises(ValueError, match="'fast' is not one of"):
        baseline_server("fast")
    for kind in LOGGING:
        with pytest.raises(ValueError, match=f"the {kind} baseline needs a directory"):
            baseline_server(kind)
