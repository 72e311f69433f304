"""Holds the newest policy version's weights, encoded once, for every subscriber to stream."""

from __future__ import annotations

import threading
import time

import torch

from proto.tensor_chunks import EncodedTensor, encode_tensors


class WeightPublisher:
    """Newest-version store behind ``WeightService``: versions only increase.

    Thread-safe. ``publish`` encodes the tensors to bytes + CRC32 once; every subscriber stream
    reads the same ``EncodedTensor`` list.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._version = -1
        self._tensors: list[EncodedTensor] = []
        self._closed = False
        self.published_at = 0.0
        """Unix time (seconds) of the newest publish."""

    @property
    def version(self) -> int:
        """Newest published version, -1 before the first."""
        return self._version

    def publish(self, version: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """Make ``version`` the newest. Raises ``ValueError`` if it is not newer than the current one."""
        if version <= self._version:
            raise ValueError(f"version {version} is not newer than published version {self._version}")
        encoded = encode_tensors(named)
        with self._cond:
            self._version, self._tensors = version, encoded
            self.published_at = time.time()
            self._cond.notify_all()

    def wait_newer(self, have_version: int, timeout_s: float) -> tuple[int, list[EncodedTensor]] | None:
        """Block up to ``timeout_s`` seconds for a version newer than ``have_version``; ``None`` on timeout or close."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._version > have_version, timeout=timeout_s)
            if self._version > have_version:
                return self._version, self._tensors
            return None

    def close(self) -> None:
        """Wake every waiting subscriber (server shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
