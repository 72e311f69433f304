"""Publishing a captured policy version behind the next learner steps.

A step waits only for ``learner.weight_capture.capture_weights`` (private copies on the weights' device); one
background thread then copies them to host memory (pinned, on a side CUDA stream, when they are on a GPU), hands
them to the determinism mode (``learner.versions``: the lockstep version store), encodes them (bytes + CRC-32C,
``proto.tensor_chunks.encode_tensors``) and makes them the weight server's newest version. Bounded: at most one
version is being published and one waits; a newer capture replaces the waiting one (rollouts only ever fetch the
newest version; the replaced one is counted in ``superseded``).

With the broadcast transport (``weight_transport: nccl``) a ``group`` (``services.learner.weight_group``) also
announces and broadcasts each version from the captured copies on their device, on a thread of its own, while the
host copy and the gRPC publish run (rollouts outside the group, and the members of a group that failed, fetch the
version over gRPC).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog
import torch

from gyre.learner.publisher import WeightPublisher
from gyre.learner.versions import LearnerVersions
from gyre.proto.tensor_chunks import encode_tensors

log = structlog.get_logger("weights")


@dataclass
class _Job:
    version: int
    timeline: int
    captured: list[tuple[str, torch.Tensor]]
    ready: torch.cuda.Event | None
    """Recorded on the capturing stream after the copies were queued (CUDA captures only)."""


class BackgroundPublisher:
    """One thread that publishes captured versions to ``publisher`` in submission order (newest wins).

    Args:
        publisher: the weight server's newest-version store.
        versions: the determinism mode (``published(version, named)`` runs before each publish).
        group: the broadcast transport's ``WeightGroup`` (``send(version, timeline, captured, ready)``), or ``None``.
    """

    def __init__(self, publisher: WeightPublisher, versions: LearnerVersions, group=None) -> None:
        self.publisher, self.versions = publisher, versions
        self.group = group
        """Settable until the first ``submit``."""
        self._group_thread: ThreadPoolExecutor | None = None
        self.superseded = 0
        """Captured versions replaced by a newer one before they were published."""
        self.last_background_s = 0.0
        """Seconds the newest completed publish took in the background (host copy, checksums, store, swap)."""
        self._cond = threading.Condition()
        self._pending: _Job | None = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self._stream = None
        self._thread = threading.Thread(target=self._run, name="weights-publish", daemon=True)
        self._thread.start()

    def submit(self, version: int, timeline: int, captured: list[tuple[str, torch.Tensor]],
               wait: bool = False) -> None:
        """Queue ``captured`` (``capture_weights``' private copies) as ``version`` of ``timeline``; with ``wait``,
        return once it is published.

        Raises:
            Exception: what an earlier background publish raised, or (``wait``) what this one raised (e.g.
                ``proto.lockstep.VersionMismatchError``), re-raised here on the learner's thread.
        """
        self.raise_if_failed()
        ready = None
        if any(t.is_cuda for _, t in captured):
            ready = torch.cuda.Event()
            ready.record()
        with self._cond:
            if self._pending is not None:
                self.superseded += 1
                log.info("weights_version_superseded", version=self._pending.version, by=version)
            self._pending = _Job(version, timeline, captured, ready)
            self._cond.notify_all()
        if wait:
            self.flush()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until nothing is waiting or being published (``timeout_s`` seconds; ``None``: no limit).

        Raises:
            Exception: what a background publish raised (``raise_if_failed``).
            TimeoutError: still publishing after ``timeout_s`` seconds.
        """
        with self._cond:
            idle = self._cond.wait_for(lambda: (self._pending is None and not self._busy) or self._error is not None,
                                       timeout=timeout_s)
        self.raise_if_failed()
        if not idle:
            raise TimeoutError(f"weights still publishing after {timeout_s}s")

    def raise_if_failed(self) -> None:
        """Re-raise what a background publish raised, if one failed (at every call after it, too: the learner
        stops publishing rather than serve versions past a failed one)."""
        if self._error is not None:
            raise self._error

    def close(self, timeout_s: float = 60.0) -> None:
        """Publish what is queued, then end the thread (at most ``timeout_s`` seconds)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)
        if self._group_thread is not None:
            self._group_thread.shutdown(wait=False)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                job, self._pending, self._busy = self._pending, None, True
            try:
                self._publish(job)
            except BaseException as exc:  # surfaced on the learner's thread (raise_if_failed)
                log.error("weights_publish_failed", version=job.version, error=f"{type(exc).__name__}: {exc}")
                self._error = exc
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _publish(self, job: _Job) -> None:
        t0 = time.perf_counter()
        sending = None
        if self.group is not None:  # the broadcast runs from the device copies while the host copy is made
            if self._group_thread is None:
                self._group_thread = ThreadPoolExecutor(1, thread_name_prefix="weights-group")
            sending = self._group_thread.submit(self.group.send, job.version, job.timeline, job.captured, job.ready)
        try:
            host = self._to_host(job)
            self.versions.published(job.version, host)
            self.publisher.publish_encoded(job.version, encode_tensors(host), timeline=job.timeline)
        finally:
            if sending is not None:
                sending.result()
        self.last_background_s = time.perf_counter() - t0

    def _to_host(self, job: _Job) -> list[tuple[str, torch.Tensor]]:
        """The captured tensors in host memory: as they are when captured there, else copied into pinned memory on
        a side stream that first waits for the capture (the training stream is not made to wait)."""
        if job.ready is None:
            return job.captured
        device = next(t.device for _, t in job.captured if t.is_cuda)
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        with torch.cuda.device(device), torch.cuda.stream(self._stream):
            self._stream.wait_event(job.ready)
            host = [(n, torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True))
                    for n, t in job.captured]
        self._stream.synchronize()
        return host
