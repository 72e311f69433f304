"""How policy versions travel from the learner to a rollout service: the transport configs both ends read.

``EngineConfig.weight_transport`` chooses one (``type: grpc | nccl``). The learner's ends are
``services/learner/weight_server.py`` (gRPC) and ``services/learner/weight_group.py`` (the broadcast group); the
rollout's are ``services/rollout/transport/`` and, inside vLLM's workers, ``rollout/weights.py``. The broadcast's own
contract is ``proto/broadcast.py`` and ``proto/buckets.py``.
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
    delta_bases: int = Field(default=2, ge=0)
    """Versions the learner keeps encoded besides the newest, as bases of sparse deltas (``proto.sparse_delta``): a
    subscriber holding one of them gets the next version as the elements that changed (NeMo-RL's sparse refit,
    verl's ``delta_sharded``). Each costs one model's bytes of host memory on the learner. ``0``: every version
    travels whole (the A/B switch)."""
    relay_fanout: int | None = Field(default=None, ge=1)
    """Relay fan-out (``services.rollout.transport.relay``): every rollout re-serves the chunks it receives, and the
    supervisor points rollout ``i`` > 0 at rollout ``(i - 1) // relay_fanout``'s relay (falling back up the tree,
    then to the learner), so the learner sends each version once, not once per rollout. ``None``: every rollout
    subscribes to the learner (fine up to ~16 rollouts; 8 is the fleet setting)."""


class NcclTransportConfig(BaseModel):
    """Manifests over gRPC ``WeightService.Announce``, bytes in a broadcast group the learner forms itself: the
    learner (rank 0) and one leader per rollout service (``services.learner.weight_group``,
    ``services.rollout.transport.nccl``). NCCL between GPUs, gloo between CPU processes (``backend``).

    The learner re-forms the group at a version boundary when a rollout joins, leaves or restarts; a rollout outside
    the group (joined after it formed, or past ``max_members``) and every member of a group whose broadcast failed
    fetch that version over gRPC (``WeightService.Subscribe``), with the reason logged."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["nccl"] = "nccl"
    """Selects this transport."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """``torch.distributed`` backend of the group: ``nccl`` (GPU tensors), ``gloo`` (CPU tensors: CPU runs and
    tests), ``auto``: ``nccl`` when the learner has a CUDA device, else ``gloo``."""
    bucket_mb: float = Field(default=256.0, gt=0)
    """Size of one broadcast in MiB (verl's ``update_weights_bucket_megabytes``): a version's tensors travel
    concatenated in buckets of this size, two staging buffers on each end (one in flight, one being filled or
    emptied), so the transfer holds ``2 × bucket_mb`` of extra device memory whatever the model's size."""
    max_members: int = Field(default=64, ge=1)
    """Rollout leaders the group takes (ranks besides the learner); a larger fleet is refused by ``gyre run``, and
    a rollout past it at run time (``gyre scale``) gets its versions over gRPC (logged ``weights_group_full``)."""
    join_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds every member has to join a newly formed group; past it that version goes over gRPC and the members
    that never joined are left out until they reconnect."""
    broadcast_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds one bucket's broadcast may take before the group is abandoned (that version goes over gRPC)."""
    chunk_timeout_s: float = Field(default=30.0, gt=0)
    """gRPC fallback: seconds a started version may go without a chunk (as ``GrpcTransportConfig``)."""
    backoff_s: float = Field(default=0.5, gt=0)
    """First reconnect delay of the control stream in seconds (doubles up to 10 s)."""

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mb`` in bytes (at least 1)."""
        return max(1, int(self.bucket_mb * (1 << 20)))


WeightTransportConfig = Annotated[Union[GrpcTransportConfig, NcclTransportConfig], Field(discriminator="type")]
"""How policy versions reach a rollout service; chosen by ``type: grpc | nccl``."""
