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
        address: ``host:port`` of the learner's WeightService, or of a parent relay (then ``fallbacks`` ends with
            the learner's).
        fallbacks: where to fetch a version when ``address`` fails (``WeightSubscriber``).
        relay: this rollout's ``RelayCache``, fed every checked chunk (``None``: it relays nothing).
        on_version: gets ``(version, [(name, CPU tensor)], timeline)`` for each verified new version.
        have_version, have_timeline: the version the engine already serves and its timeline.
    """

    def __init__(self, config: GrpcTransportConfig, address: str, on_version: OnVersion, have_version: int = -1,
                 name: str = "", security: SecurityConfig | None = None, have_timeline: int = 0,
                 fallbacks: tuple[str, ...] = (), relay=None) -> None:
        self.address, self.security = address, security
        self.upstreams = (address, *fallbacks)
        """Where versions come from: a parent relay first, then its ancestors and the learner (last)."""
        self._subscriber = WeightSubscriber(
            address, on_version, have_version=have_version, name=name, chunk_timeout_s=config.chunk_timeout_s,
            backoff_s=config.backoff_s, max_backoff_s=config.max_backoff_s, security=security,
            have_timeline=have_timeline, fallbacks=fallbacks, relay=relay)

    def start(self) -> "GrpcTransport":
        self._subscriber.start()
        return self

    def stop(self) -> None:
        self._subscriber.stop()

    def latest_version(self, timeout_s: float = 2.0) -> int | None:
        return latest_version(self.upstreams[-1], timeout_s, self.security)  # the learner's, not a relay's

    @property
    def delivered_version(self) -> int:
        return self._subscriber.have_version

    @property
    def errors(self) -> int:
        return self._subscriber.errors
