"""Baseline servers of ``bench.replay``'s ingest ratios, each in its own process like the replay server.

All four take the same ``InsertRequest`` stream on the same bidi method shape, with the same gRPC
server options, GIL switch interval and malloc tuning (``replay.memory.tune_malloc``) as the replay
server, and answer each message once it is handled:

- ``raw``: answers at once and keeps nothing (the issue's baseline; each message's transient buffers
  reuse freed memory).
- ``keep``: reads each payload out of its request and keeps it, as any buffer must. Every payload is
  then new memory, which on a VM that hands freed memory back to its host costs page faults per MiB
  that the raw stream never pays (docs/benchmarks.md, the ingest ceiling). This is the ceiling of any server
  that keeps what it stores, measured in the same run.
- ``append``: ``keep`` plus appending each payload to one file before the answer (no fsync): the least
  a buffer with ``durability: write`` does per message, the ceiling of ``ingest_ratio_nofsync``.
- ``durable``: ``append`` and fsync before the answer, with group commit (``GroupCommitLog``): the
  least a durable buffer does per message, the ceiling of ``ingest_ratio``.

``append`` and ``durable`` do not validate, index, checksum or frame anything.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import grpc

from gyre.proto import replay_pb2
from gyre.replay.memory import tune_malloc
from gyre.services.common import grpc_common, port_file

KINDS = ("raw", "keep", "append", "durable")
LOGGING = ("append", "durable")
"""The baselines that append each payload to ``directory / "log"``."""
SERVICE = "gyre.bench.v1.RawBytes"
RAW_METHOD = f"/{SERVICE}/Insert"
GIL_SWITCH_S = 0.001
"""The replay server's GIL switch interval (``services.replay.server``)."""


class GroupCommitLog:
    """An append-only file whose ``append`` returns once the bytes are fsync'd; concurrent appends
    share one fsync (group commit: the thread that finds its bytes not yet durable fsyncs everything
    written so far).

    Args:
        path: the file (created or truncated).
        fsync: ``False`` skips the fsync (each append returns once written to the page cache).

    Raises:
        OSError: the file cannot be opened, written or fsync'd.
    """

    def __init__(self, path: Path, fsync: bool = True) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.fsync = fsync
        self.written = self.synced = 0
        """Bytes written / bytes known fsync'd."""
        self._write_lock, self._sync_lock = threading.Lock(), threading.Lock()

    def append(self, data: bytes) -> int:
        """Write all of ``data`` and (with ``fsync``) wait until it is on disk; returns the file offset
        its last byte ends at (bytes)."""
        view = memoryview(data)
        with self._write_lock:
            while view:
                view = view[os.write(self.fd, view):]
            self.written += len(data)
            end = self.written
        if not self.fsync:
            return end
        with self._sync_lock:
            if self.synced < end:
                target = self.written  # every write counted here has completed
                os.fsync(self.fd)
                self.synced = target
        return end

    def close(self) -> None:
        os.close(self.fd)


def baseline_server(kind: str, port: int = 0, directory: Path | None = None) -> tuple[grpc.Server, int, list]:
    """Start a ``kind`` baseline server (see the module doc) on 127.0.0.1; returns ``(server, port,
    kept)`` where ``kept`` is the list every server but ``raw`` appends each payload to.
    ``append`` and ``durable`` write ``directory / "log"``.

    Raises:
        ValueError: ``kind`` is not one of ``KINDS``, or one of ``LOGGING`` without ``directory``.
    """
    if kind not in KINDS:
        raise ValueError(f"baseline kind {kind!r} is not one of {KINDS}")
    if kind in LOGGING and directory is None:
        raise ValueError(f"the {kind} baseline needs a directory for its log")
    sys.setswitchinterval(GIL_SWITCH_S)
    tune_malloc()
    kept: list[bytes] = []
    log = GroupCommitLog(directory / "log", fsync=kind == "durable") if kind in LOGGING else None

    def insert(request_iterator, context):
        for req in request_iterator:
            if kind != "raw":
                payload = req.arrow_ipc  # a copy, into new memory that stays
                kept.append(payload)
                if log is not None:
                    log.append(payload)
            yield replay_pb2.InsertResponse(batch_id=req.batch_id, accepted=1)

    server, health = grpc_common.make_server()
    handler = grpc.stream_stream_rpc_method_handler(
        insert, request_deserializer=replay_pb2.InsertRequest.FromString,
        response_serializer=replay_pb2.InsertResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Insert": handler}),))
    port = grpc_common.start(server, health, SERVICE, "127.0.0.1", port)
    return server, port, kept


def serve(kind: str, port_file_path: str, directory: Path | None = None) -> None:
    """Run a baseline server on a port the OS picks, written to ``port_file_path`` once serving, until
    SIGTERM/SIGINT (the process ``bench.replay_parts.Server`` starts)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    server, port, _ = baseline_server(kind, 0, directory)
    port_file.write(port_file_path, port)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.stop(grace=None)
