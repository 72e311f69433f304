"""Holds the newest policy version's weights, encoded once, for every subscriber to stream."""

from __future__ import annotations

import threading
import time

import torch

from proto.tensor_chunks import EncodedTensor, TensorMeta, encode_tensors


class WeightPublisher:
    """Newest-version store behind ``WeightService``: versions only increase.

    Thread-safe. ``publish`` encodes the tensors to bytes + CRC-32C once; every subscriber stream
    reads the same ``EncodedTensor`` list. ``announce`` instead records only a version's manifest
    (names, shapes, checksums) for transports whose bytes travel over NCCL
    (``services.weight_transport.nccl``); one publisher holds one kind of version at a time.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._version = -1
        self._tensors: list[EncodedTensor] = []
        self._manifest: list[TensorMeta] | None = None
        self._closed = False
        self.published_at = 0.0
        """Unix time (seconds) of the newest publish."""

    @property
    def version(self) -> int:
        """Newest published version, -1 before the first."""
        return self._version

    def publish(self, version: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """Make ``version`` the newest. Raises ``ValueError`` if it is not newer than the current one."""
        self._check_newer(version)
        encoded = encode_tensors(named)
        with self._cond:
            self._check_newer(version)
            self._version, self._tensors, self._manifest = version, encoded, None
            self.published_at = time.time()
            self._cond.notify_all()

    def announce(self, version: int, manifest: list[TensorMeta]) -> None:
        """Make ``version`` the newest, bytes sent elsewhere (a broadcast that follows); ``Announce``
        streams ``manifest`` to subscribers. Raises ``ValueError`` if it is not newer than the current one."""
        with self._cond:
            self._check_newer(version)
            self._version, self._tensors, self._manifest = version, [], list(manifest)
            self.published_at = time.time()
            self._cond.notify_all()

    def _check_newer(self, version: int) -> None:
        if version <= self._version:
            raise ValueError(f"version {version} is not newer than published version {self._version}")

    def wait_newer(self, have_version: int, timeout_s: float) -> tuple[int, list[EncodedTensor]] | None:
        """Block up to ``timeout_s`` seconds for a version newer than ``have_version``; ``None`` on timeout or close."""
        with self._cond:
            def ready() -> bool:
                return self._version > have_version and self._manifest is None

            self._cond.wait_for(lambda: self._closed or ready(), timeout=timeout_s)
            if ready():
                return self._version, self._tensors
            return None

    def wait_newer_manifest(self, have_version: int, timeout_s: float) -> tuple[int, list[TensorMeta]] | None:
        """Like ``wait_newer`` for announced (manifest-only) versions; ``None`` on timeout or close."""
        with self._cond:
            def ready() -> bool:
                return self._version > have_version and self._manifest is not None

            self._cond.wait_for(lambda: self._closed or ready(), timeout=timeout_s)
            if ready():
                return self._version, self._manifest
            return None

    def close(self) -> None:
        """Wake every waiting subscriber (server shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
