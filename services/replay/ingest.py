"""The replay server's insert stage: one thread stores what every Insert stream received, in batches.

Each Insert stream has a reader thread that only receives requests and queues their fields here
(``Received``: the payload is read out of the protobuf once, there), and a handler that answers them
in order once durable. The stage's one thread takes everything queued
(up to ``max_batch`` requests and ``max_batch_bytes``), checks each request, and stores the good ones
with one ``TrajectoryBuffer.insert_batch``: the validation, split, WAL write and apply run once per
batch instead of once per request, which is what a replay process's CPU goes on under load (the
GIL makes that work serial anyway). Where a batch cannot be stored as one step (see
``insert_batch``), its requests are stored one by one, as before, with the same errors.

A stream whose request failed gets that error and nothing more of it is stored; its later requests
already queued are dropped (the client retries them after the stream error; inserts are idempotent).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass, field

import grpc
import pyarrow as pa
import structlog

from gyre.proto import replay_pb2
from gyre.proto.trajectory import SCHEMA_VERSION, SchemaError
from gyre.replay.buffer import RateLimitedError, TrajectoryBuffer
from gyre.replay.wal import WalError

log = structlog.get_logger("replay")
END = object()
"""Queued after a stream's last request (and put on its answers when the stage reaches it)."""


class Abort(Exception):
    """An RPC error to send: ``code`` and a message naming the bad value."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Received:
    """An ``InsertRequest``'s fields, read once by the stream's reader thread: reading ``arrow_ipc``
    from the protobuf copies the payload (into the memory the stored groups then keep), so it is
    done there, beside the ingest thread, and never twice."""

    schema_version: int
    batch_id: int
    arrow_ipc: bytes


@dataclass
class Stream:
    """One Insert stream: its answers (``(lsn, InsertResponse)``, an ``Abort`` or ``END``), in request order."""

    answers: queue.Queue = field(default_factory=queue.Queue)
    received: collections.deque = field(default_factory=collections.deque)
    """``time.monotonic()`` at which each request not answered yet arrived, in order (its insert latency)."""
    failed: bool = False
    """An error was queued: nothing more of this stream is stored."""

    def fail(self, exc: Abort) -> None:
        if not self.failed:
            self.failed = True
            self.answers.put(exc)


def check_schema(version: int) -> None:
    """A request's ``schema_version`` is this server's, else an INVALID_ARGUMENT ``Abort`` naming both."""
    if version != SCHEMA_VERSION:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                    f"schema_version {version} is not supported; this server speaks {SCHEMA_VERSION}")


def _rejected(req, exc: SchemaError) -> Abort:
    log.warning("insert_rejected", batch_id=req.batch_id, error=str(exc))
    return Abort(grpc.StatusCode.INVALID_ARGUMENT, f"batch {req.batch_id}: {exc}")


def read_ipc(payload) -> pa.Table:
    """Parse Arrow IPC bytes (the table's buffers point into ``payload``, no copy) and check offsets and
    lengths are in range (compute kernels trust them). Raises ``SchemaError``."""
    try:
        table = pa.ipc.open_stream(pa.py_buffer(payload)).read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError) as exc:  # ArrowInvalid, ArrowNotImplementedError (unknown types), ...
        raise SchemaError(f"payload is not an Arrow IPC stream: {exc}") from exc
    return table


def aligned(payload) -> pa.Buffer:
    """``payload`` as an Arrow buffer whose first byte is 8-byte aligned (Arrow IPC's buffer
    alignment: Arrow reads IPC buffers in place, and C++ kernels may fault on misaligned ones): as is
    when it already is, else one copy into Arrow's (64-byte aligned) memory, made with the GIL released."""
    buf = pa.py_buffer(payload)
    if buf.address % 8 == 0:
        return buf
    out = pa.allocate_buffer(buf.size)
    pa.FixedSizeBufferWriter(out).write(buf)
    return out


class IngestStage:
    """The batching insert thread of one replay server (started on first use; a daemon).

    Args:
        buffer: where inserts go.
        max_batch: most requests stored as one batch.
        max_batch_bytes: most payload bytes in one batch (a request larger than it goes alone).
        max_queued_bytes: payload bytes queued from all streams, not yet stored, before readers wait
            (gRPC flow control then holds clients back); a request larger than it is queued alone.
    """

    def __init__(self, buffer: TrajectoryBuffer, max_batch: int = 8, max_batch_bytes: int = 64 << 20,
                 max_queued_bytes: int = 128 << 20) -> None:
        self.buffer, self.max_batch, self.max_batch_bytes = buffer, max_batch, max_batch_bytes
        self.max_queued_bytes = max_queued_bytes
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._room = threading.Condition()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, stream: Stream, item, deadline: float | None = None) -> None:
        """Queue a request of ``stream`` (an ``InsertRequest``, queued as its ``Received`` fields;
        ``deadline``: ``time.monotonic()`` by which its rate-limiter wait ends), an ``Abort`` to answer
        once the stream's earlier requests are answered, or ``END``. Blocks while ``max_queued_bytes``
        are queued."""
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="replay-ingest", daemon=True)
                    self._thread.start()
        size = 0
        if isinstance(item, replay_pb2.InsertRequest):
            item = Received(item.schema_version, item.batch_id, item.arrow_ipc)
            size = len(item.arrow_ipc)
        with self._room:
            self._room.wait_for(lambda: self._queued_bytes == 0 or self._queued_bytes + size <= self.max_queued_bytes)
            self._queued_bytes += size
        self._queue.put((stream, item, deadline, size))

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            nbytes = batch[0][3]
            while len(batch) < self.max_batch and nbytes < self.max_batch_bytes:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
                nbytes += batch[-1][3]
            try:
                self.store([(stream, item, deadline) for stream, item, deadline, _ in batch])
            except Exception as exc:  # a bug: say so (INTERNAL) to every stream in the batch, never CANCELLED
                log.exception("insert_failed")
                for stream, *_ in batch:
                    stream.fail(Abort(grpc.StatusCode.INTERNAL, f"insert failed: {type(exc).__name__}: {exc}"))
                    stream.answers.put(END)
            finally:
                with self._room:
                    self._queued_bytes -= nbytes
                    self._room.notify_all()

    def store(self, batch: list) -> None:
        """Check each request, store the good ones (as one batch where possible), answer each stream
        in request order. ``batch``: ``[(stream, item, deadline), ...]`` as ``submit`` queued them."""
        ready, failing = [], set()  # (stream, request | Abort | END, table, payload, deadline)
        with self.buffer.foreground():  # a snapshot's next step waits for it (not for the rate limiter)
            for stream, item, deadline in batch:
                if item is not END and (stream.failed or id(stream) in failing):
                    continue  # after an error nothing more of the stream is stored
                if item is END or isinstance(item, Abort):
                    ready.append((stream, item, None, None, None))
                    continue
                try:
                    payload = self._checked_payload(item)
                    ready.append((stream, item, read_ipc(payload), payload, deadline))
                    continue
                except Abort as exc:
                    error = exc
                except SchemaError as exc:
                    error = _rejected(item, exc)
                failing.add(id(stream))
                ready.append((stream, error, None, None, None))
        inserts = [(table, payload) for _, _, table, payload, _ in ready if table is not None]
        stored = None
        if len(inserts) > 1:
            try:
                stored = self.buffer.insert_batch(inserts)
            except WalError as exc:
                stored = [Abort(grpc.StatusCode.UNAVAILABLE, f"replay cannot persist: {exc}")] * len(inserts)
        answers = iter(stored or ())
        for stream, item, table, payload, deadline in ready:
            if item is END:
                stream.answers.put(END)
            elif isinstance(item, Abort):
                stream.fail(item)
            elif stored is not None:
                self._answer(stream, item, next(answers))
            elif not stream.failed:  # one by one: a failed insert stops its stream's later ones
                self._answer(stream, item, self._insert_one(item, table, payload, deadline))

    def _checked_payload(self, req) -> pa.Buffer:
        check_schema(req.schema_version)
        payload, limit = req.arrow_ipc, self.buffer.config.max_batch_bytes  # a Received's bytes, no copy
        if len(payload) > limit:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"batch {req.batch_id}: arrow_ipc is {len(payload)} bytes; limit is {limit}")
        return aligned(payload)

    def _insert_one(self, req, table: pa.Table, payload, deadline: float | None):
        timeout = self.buffer.config.insert_timeout_s
        if deadline is not None:
            timeout = max(0.0, min(timeout, deadline - time.monotonic()))
        try:
            with self.buffer.foreground():
                return self.buffer.insert_nowait(table, payload, timeout)
        except SchemaError as exc:
            return _rejected(req, exc)
        except RateLimitedError as exc:
            return Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"batch {req.batch_id}: {exc}")
        except WalError as exc:
            return Abort(grpc.StatusCode.UNAVAILABLE, f"replay cannot persist: {exc}")

    @staticmethod
    def _answer(stream: Stream, req, answer) -> None:
        if isinstance(answer, Abort):
            stream.fail(answer)
            return
        result, lsn = answer
        stream.answers.put((lsn, replay_pb2.InsertResponse(
            batch_id=req.batch_id, accepted=result.accepted, duplicates=result.duplicates,
            dropped_stale=result.dropped_stale)))
