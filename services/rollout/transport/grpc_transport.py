"""``GrpcTransport``: policy versions as checksummed chunks over ``WeightService.Subscribe``."""

from __future__ import annotations

from gyre.proto.weight_transport import GrpcTransportConfig
from gyre.services.common.security import SecurityConfig
from gyre.services.rollout.transport.base import OnVersion, WeightTransport
from gyre.services.rollout.transport.subscriber import WeightSubscriber, latest_version


class GrpcTransport(WeightTransport):
    """Wraps ``services.rollout.transport.subscriber.WeightSubscriber`` (staging, CRC-32C per tensor, chunk deadline,
    exponential backoff, versions only forward within a timeline) behind the ``WeightTransport`` ABC.

    Args:
        address: ``host:port`` of the learner's WeightService.
        on_version: gets ``(version, [(name, CPU tensor)], timeline)`` for each verified new version.
        have_version, have_timeline: the version the engine already serves and its timeline.
    """

    def __init__(self, config: GrpcTransportConfig, address: str, on_version: OnVersion, have_version: int = -1,
                 name: str = "", security: SecurityConfig | None = None, have_timeline: int = 0) -> None:
        self.address, self.security = address, security
        self._subscriber = WeightSubscriber(
            address, on_version, have_version=have_version, name=name, chunk_timeout_s=config.chunk_timeout_s,
            backoff_s=config.backoff_s, max_backoff_s=config.max_backoff_s, security=security,
            have_timeline=have_timeline)

    def start(self) -> "GrpcTransport":
        self._subscriber.start()
        return self

    def stop(self) -> None:
        self._subscriber.stop()

    def latest_version(self, timeout_s: float = 2.0) -> int | None:
        return latest_version(self.address, timeout_s, self.security)

    @property
    def delivered_version(self) -> int:
        return self._subscriber.have_version

    @property
    def errors(self) -> int:
        return self._subscriber.errors
