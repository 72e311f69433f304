"""How policy versions travel from the learner to a rollout service: the transport configs both ends read.

``EngineConfig.weight_transport`` chooses one (``type: grpc | nccl``). The learner's ends are
``services/learner/weight_server.py`` (gRPC) and ``services/learner/weight_broadcast.py`` (NCCL); the rollout's
are ``services/rollout/transport/`` and, inside vLLM's workers, ``rollout/weights.py``. The NCCL data path's own
contract (the ``Broadcast`` collective and ``receive_verified``) is ``proto/broadcast.py``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class GrpcTransportConfig(BaseModel):
    """Weights stream over the learner's gRPC ``WeightService.Subscribe`` (portable default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["grpc"] = "grpc"
    """Selects this transport."""
    chunk_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds a started version may go without a chunk before the stream is abandoned and retried."""
    backoff_s: float = Field(default=0.5, gt=0)
    """First reconnect delay in seconds; doubles per failure up to ``max_backoff_s``."""
    max_backoff_s: float = Field(default=10.0, gt=0)
    """Longest reconnect delay in seconds."""
    relay_fanout: int | None = Field(default=None, ge=1)
    """Relay fan-out (``services.rollout.transport.relay``): every rollout re-serves the chunks it receives, and the
    supervisor points rollout ``i`` > 0 at rollout ``(i - 1) // relay_fanout``'s relay (falling back up the tree,
    then to the learner), so the learner sends each version once, not once per rollout. ``None``: every rollout
    subscribes to the learner (fine up to ~16 rollouts; 8 is the fleet setting)."""


class NcclTransportConfig(BaseModel):
    """Manifests (version, names, shapes, checksums) over gRPC ``WeightService.Announce``, bytes over an
    NCCL broadcast from the learner (rank 0) into the vLLM workers through vLLM's weight-transfer API.
    Needs CUDA on the learner and every rollout; the group has a fixed size."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["nccl"] = "nccl"
    """Selects this transport."""
    master_address: str
    """Host of the learner's rendezvous store (TCPStore) for the NCCL group."""
    master_port: int = Field(ge=1, le=65535)
    """Port of that store."""
    world_size: int = Field(ge=2)
    """Ranks in the group: 1 (learner) + the vLLM workers of every rollout service."""
    rank_offset: int = Field(ge=1)
    """This rollout's first worker rank in the group (the learner is rank 0)."""
    backoff_s: float = Field(default=0.5, gt=0)
    """First reconnect delay of the control stream in seconds (doubles up to 10 s)."""
    broadcast_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds one version's broadcast may take; past it the engine fails loudly (``EngineFailedError``)
    instead of hanging in NCCL, and the rollout must be restarted (its weights are undefined)."""


WeightTransportConfig = Annotated[Union[GrpcTransportConfig, NcclTransportConfig], Field(discriminator="type")]
"""How policy versions reach a rollout service; chosen by ``type: grpc | nccl``."""
