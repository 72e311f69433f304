"""Background archive uploads of committed checkpoints (``learner.archive``), one at a time, in order.

A checkpoint stays listed in ``pending`` until its upload has ended, so the primary's prune can spare it
(``CheckpointRequest.protected``): an upload slower than training used to find its checkpoint pruned
(``manifest.json is missing``). A failed upload is logged and counted, never raised: an unreachable bucket
must not stop training.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import structlog

log = structlog.get_logger("gyre.learner.checkpoint.archive")


class ArchiveUploads:
    """Uploads to ``archive`` (``learner.archive.ArchiveConfig``); ``failures`` counts the ones that failed."""

    def __init__(self, archive) -> None:
        self.archive, self.failures = archive, 0
        self._executor: ThreadPoolExecutor | None = None
        self._uploads: dict[str, Future] = {}
        """Checkpoint name → its upload (the newest submission per name)."""

    def submit(self, path: Path) -> None:
        """Queue the upload of the committed checkpoint ``path``, then the archive's pruning."""
        from gyre.learner.checkpoint.archive import archive_checkpoint, prune_archive

        def upload() -> None:
            try:
                archive_checkpoint(path, self.archive)
                prune_archive(self.archive)
            except Exception as exc:  # recovery path: the bucket failing must not stop training
                self.failures += 1
                log.error("checkpoint_archive_failed", path=str(path), error=f"{type(exc).__name__}: {exc}")

        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-ckpt-archive")
        self._uploads[path.name] = self._executor.submit(upload)

    def pending(self) -> frozenset[str]:
        """Names of the checkpoints whose upload has not ended (read from the saver's thread)."""
        return frozenset(name for name, fut in list(self._uploads.items()) if not fut.done())

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every queued upload ended (end of run, tests)."""
        for fut in list(self._uploads.values()):
            fut.exception(timeout=timeout_s)
        self._uploads = {name: fut for name, fut in self._uploads.items() if not fut.done()}
