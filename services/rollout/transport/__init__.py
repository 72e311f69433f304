"""Weight transports (``type: grpc | nccl``) behind one ABC, chosen by ``EngineConfig.weight_transport``."""

from __future__ import annotations

from gyre.proto.weight_transport import GrpcTransportConfig, NcclTransportConfig
from gyre.services.common.security import SecurityConfig
from gyre.services.rollout.transport.base import OnVersion, Payload, TransportUnavailableError, WeightTransport

__all__ = ["OnVersion", "Payload", "TransportUnavailableError", "WeightTransport", "make_transport"]


def make_transport(config: GrpcTransportConfig | NcclTransportConfig, address: str, on_version: OnVersion,
                   have_version: int = -1, name: str = "",
                   security: SecurityConfig | None = None, have_timeline: int = 0,
                   relays: tuple[str, ...] = (), relay=None) -> WeightTransport:
    """The transport ``config.type`` names, not started. ``address`` is the learner's WeightService;
    ``(have_version, have_timeline)`` is what the engine serves (``proto.timeline``). gRPC only: ``relays`` are the
    relay addresses to fetch from before the learner (nearest first), ``relay`` this rollout's ``RelayCache``.

    ``type: nccl`` starts on any machine: whether its group can use NCCL is known per group (the learner names the
    backend), and a rollout that cannot take part fetches over gRPC.
    """
    if config.type == "nccl":
        from gyre.services.rollout.transport.nccl import NcclTransport
        return NcclTransport(config, address, on_version, have_version, name, security, have_timeline=have_timeline)
    from gyre.services.rollout.transport.grpc_transport import GrpcTransport
    upstreams = (*relays, address)
    return GrpcTransport(config, upstreams[0], on_version, have_version, name, security, have_timeline=have_timeline,
                         fallbacks=upstreams[1:], relay=relay)
