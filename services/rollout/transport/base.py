"""The weight-transport ABC: how a rollout service learns of and receives new policy versions."""

from __future__ import annotations

import abc
from typing import Callable, Union

import torch

from gyre.proto.broadcast import TransportUnavailableError
from gyre.proto.manifest import VersionManifest

__all__ = ["OnVersion", "Payload", "TransportUnavailableError", "WeightTransport"]

Payload = Union[list[tuple[str, torch.Tensor]], VersionManifest]
"""What ``on_version`` gets: the named tensors themselves (gRPC), or the manifest of tensors that the
engine must now receive from a broadcast (NCCL); ``RolloutEngine.update_weights`` takes either."""

OnVersion = Callable[[int, Payload, int], None]
"""``on_version(version, payload, timeline)``: called in the transport's thread, once per new version
(``proto.timeline.is_new``: newer, or of another timeline), in publish order. If it raises, the version is
not counted as delivered."""


class WeightTransport(abc.ABC):
    """Follows the learner's newest policy version and hands each newer one to ``on_version``.

    Contract shared by every implementation (``GrpcTransport``, ``NcclTransport``): versions only move
    forward within a timeline (a duplicate or older version of the same timeline is dropped; any version of
    another timeline is delivered: the learner rewound, ``proto.timeline``); every tensor is verified against its checksum
    before ``on_version`` sees it; a stalled or broken transfer is abandoned and retried with backoff,
    never a hang; ``start``/``stop`` are idempotent-safe to call once each.
    """

    @abc.abstractmethod
    def start(self) -> "WeightTransport":
        """Start following in a background thread; returns ``self``."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop following; an in-flight transfer is cancelled (bounded wait, seconds)."""

    @abc.abstractmethod
    def latest_version(self, timeout_s: float = 2.0) -> int | None:
        """The learner's newest published version (-1 before the first), or ``None`` if the learner
        did not answer within ``timeout_s`` seconds."""

    @property
    @abc.abstractmethod
    def delivered_version(self) -> int:
        """Newest version handed to ``on_version`` successfully (or the ``have_version`` it started at)."""

    @property
    @abc.abstractmethod
    def errors(self) -> int:
        """Broken or refused transfers so far (each one was retried)."""
