"""Holds the newest policy version's weights, encoded once, for every subscriber to stream."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable

import torch

from gyre.proto.tensor_chunks import EncodedTensor, encode_tensors
from gyre.proto.manifest import TensorMeta
from gyre.proto.timeline import SHARED, is_new


class WeightPublisher:
    """Newest-version store behind ``WeightService``: versions only increase (within one learner process).

    Each version carries its ``timeline`` (``proto.timeline``: the learner incarnation; ``SHARED`` by
    default); a subscriber holding another timeline gets the newest version whatever its number. Thread-safe.
    ``publish`` encodes the tensors to bytes + CRC-32C once; every subscriber stream reads the same
    ``EncodedTensor`` list. ``announce`` records a version's manifest (names, shapes, checksums) and the broadcast
    group its bytes travel in (``services.learner.weight_group``), served by ``Announce``; the two are kept apart,
    so one version may be both announced (its members take it from the broadcast) and published (everyone else
    fetches it over ``Subscribe``).
    """

    def __init__(self, delta_bases: int = 2) -> None:
        if delta_bases < 0:
            raise ValueError(f"delta_bases ({delta_bases}) must be >= 0")
        self.delta_bases = delta_bases
        """Published versions kept (encoded) besides the newest, as bases of sparse deltas (``proto.sparse_delta``)."""
        self._history: OrderedDict[tuple[int, int], list[EncodedTensor]] = OrderedDict()
        self._cond = threading.Condition()
        self._version = -1
        self._timeline = SHARED
        self._tensors: list[EncodedTensor] = []
        self._announced: tuple[int, int, tuple[list[TensorMeta], object]] | None = None
        """``(version, timeline, (manifest, group))`` of the newest ``announce``."""
        self._closed = False
        self._listeners: list[Callable[[], None]] = []
        self.published_at = 0.0
        """Unix time (seconds) of the newest publish."""

    @property
    def version(self) -> int:
        """Newest published version, -1 before the first."""
        return self._version

    @property
    def timeline(self) -> int:
        """Timeline of the newest published version (``SHARED`` before the first)."""
        return self._timeline

    def latest(self) -> tuple[int, int]:
        """``(version, timeline)`` of the newest publish or announce, read together (``(-1, SHARED)`` before the
        first)."""
        with self._cond:
            if self._announced is not None and self._announced[0] > self._version:
                return self._announced[0], self._announced[1]
            return self._version, self._timeline

    def publish(self, version: int, named: list[tuple[str, torch.Tensor]], timeline: int = SHARED) -> None:
        """Make ``version`` (of ``timeline``) the newest. Raises ``ValueError`` if it is not newer than the
        current one."""
        self._check_newer(version)
        self.publish_encoded(version, encode_tensors(named), timeline)

    def publish_encoded(self, version: int, encoded: list[EncodedTensor], timeline: int = SHARED) -> None:
        """``publish`` for tensors already encoded (``encode_tensors``: e.g. in ``learner.background_publish``).
        Raises ``ValueError`` if ``version`` is not newer than the current one."""
        with self._cond:
            self._check_newer(version)
            self._version, self._timeline, self._tensors = version, timeline, list(encoded)
            self._history[(version, timeline)] = self._tensors
            while len(self._history) > self.delta_bases + 1:
                self._history.popitem(last=False)
            self.published_at = time.time()
            self._cond.notify_all()
        self._notify()

    def encoded(self, version: int, timeline: int) -> list[EncodedTensor] | None:
        """The encoded tensors of ``(version, timeline)`` if it is the newest or one of the ``delta_bases`` before."""
        with self._cond:
            return self._history.get((version, timeline))

    def announce(self, version: int, manifest: list[TensorMeta], timeline: int = SHARED, group=None) -> None:
        """Make ``version`` the newest announced one: ``Announce`` streams ``manifest`` and ``group`` (the broadcast
        its bytes follow in: a ``weights_pb2.BroadcastGroup``, or ``None``) to its followers. Independent of
        ``publish``. Raises ``ValueError`` if it is not newer than the newest announced version."""
        with self._cond:
            if self._announced is not None and version <= self._announced[0]:
                raise ValueError(f"version {version} is not newer than announced version {self._announced[0]}")
            self._announced = (version, timeline, (list(manifest), group))
            self._cond.notify_all()
        self._notify()

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (no arguments, from the publishing thread, outside the lock; it must not block)
        after every ``publish``, ``announce`` and ``close``: how an ``asyncio`` server learns of a new version."""
        with self._cond:
            self._listeners.append(callback)

    def _notify(self) -> None:
        with self._cond:
            listeners = list(self._listeners)
        for callback in listeners:
            callback()

    def offer(self, have_version: int, have_timeline: int, manifest: bool = False) -> tuple[int, int, object] | None:
        """``wait_offer`` without waiting: the newest version new to ``(have_version, have_timeline)`` or ``None``."""
        return self._wait(have_version, have_timeline, 0.0, manifest)

    @property
    def closed(self) -> bool:
        """``close`` was called."""
        return self._closed

    def _check_newer(self, version: int) -> None:
        if version <= self._version:
            raise ValueError(f"version {version} is not newer than published version {self._version}")

    def wait_newer(self, have_version: int, timeout_s: float,
                   have_timeline: int = SHARED) -> tuple[int, list[EncodedTensor]] | None:
        """Block up to ``timeout_s`` seconds for a published version new to a subscriber holding
        ``(have_version, have_timeline)`` (``proto.timeline.is_new``); returns ``(version, tensors)`` (its
        timeline: ``self.timeline`` then), or ``None`` on timeout or close."""
        got = self._wait(have_version, have_timeline, timeout_s, manifest=False)
        return (got[0], got[2]) if got is not None else None

    def wait_newer_manifest(self, have_version: int, timeout_s: float,
                            have_timeline: int = SHARED) -> tuple[int, list[TensorMeta]] | None:
        """Like ``wait_newer`` for announced versions: ``(version, manifest)``; ``None`` on timeout or close."""
        got = self._wait(have_version, have_timeline, timeout_s, manifest=True)
        return (got[0], got[2][0]) if got is not None else None

    def wait_offer(self, have_version: int, have_timeline: int, timeout_s: float,
                   manifest: bool = False) -> tuple[int, int, list] | None:
        """``(version, timeline, tensors)`` (``manifest``: ``(version, timeline, (manifest, group))`` of the newest
        announce) new to a subscriber holding ``(have_version, have_timeline)``, read atomically; ``None`` after
        ``timeout_s`` seconds or on close."""
        return self._wait(have_version, have_timeline, timeout_s, manifest)

    def _wait(self, have_version: int, have_timeline: int, timeout_s: float, manifest: bool):
        with self._cond:
            def newest():
                if manifest:
                    return self._announced
                return (self._version, self._timeline, self._tensors) if self._version >= 0 else None

            def ready() -> bool:
                got = newest()
                return got is not None and is_new(got[0], got[1], have_version, have_timeline)

            self._cond.wait_for(lambda: self._closed or ready(), timeout=timeout_s)
            return newest() if ready() else None

    def close(self) -> None:
        """Wake every waiting subscriber (server shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._notify()
