"""What each service actor's ``describe()`` answers: one frozen record per actor kind.

The supervisor calls ``describe()`` every tick (its health check) and keeps the answer as ``Service.info``; its
status and the controller's metrics rows read these attributes. The records cross Ray as control messages
(pickled by Ray, like any actor return value); nothing of gyre's own stores them. ``gyre status`` publishes
plain values read from them (``Supervisor.status``).

One record per kind rather than one with optional fields: the kinds share only the process columns of the
status table (``ServiceInfo``), and the rest differs (replay's buffer gauges, the learner's checkpoint state,
a rollout's generation stats), so a field present on a record is always filled in.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class ServiceInfo:
    """What every service reports: the columns of ``gyre status``'s service table."""

    pid: int
    node: str
    """IP of the Ray node the actor runs on."""
    metrics_port: int | None = None
    """Port of its Prometheus ``/metrics`` (``None``: not served)."""
    version: int | None = None
    """Policy version it holds (``None`` for replay, which holds none)."""


@dataclass(frozen=True, kw_only=True)
class ReplayInfo(ServiceInfo):
    """``ReplayActor.describe()``."""

    address: str
    """``host:port`` of its ReplayService."""
    replay_groups: int
    """Groups stored (pooled, leased or excluded)."""
    replay_trajectories: int
    learner_version: int
    """Newest learner version replay has seen (from ``sample``/``rejoin``)."""
    inserts_per_s: float


@dataclass(frozen=True, kw_only=True)
class LearnerInfo(ServiceInfo):
    """``LearnerActor.describe()`` (rank 0 of the learner)."""

    address: str
    """``host:port`` of its WeightService."""
    version: int
    timeline: int
    """Timeline of the weights it publishes (``proto.timeline``)."""
    running: bool
    """Whether ``run`` is training now."""
    resumed_from: str
    """Checkpoint directory it resumed from (``""``: none)."""
    last_checkpoint: str
    """Newest committed checkpoint directory (``""``: none)."""
    checkpoint_age_s: float | None
    """Seconds since that checkpoint was written (``None``: none yet)."""
    tokens_per_s: float | None
    """Of the last step (``None``: no step yet)."""


@dataclass(frozen=True, kw_only=True)
class LearnerRankInfo(ServiceInfo):
    """``LearnerRankActor.describe()`` (ranks >= 1 of a multi-rank learner)."""

    rank: int
    version: int
    following: bool
    """Whether it is running rank 0's commands."""


@dataclass(frozen=True, kw_only=True)
class RolloutInfo(ServiceInfo):
    """``RolloutActor.describe()``."""

    version: int
    """Policy version it serves (lockstep: the newest offered)."""
    generating: bool
    tokens_per_s: float
    """Generated tokens per second since it started."""
    stats: dict = field(default_factory=dict)
    """Its ``rollout.stats.RolloutStats.as_dict`` (reward means and counts, spool gauges, ...)."""
    reward_versions: dict[str, str] = field(default_factory=dict)
    """``{task: reward_fn_version}`` scoring the groups it starts now (``TaskSource.reward_versions``)."""
    relay_address: str | None = None
    """``host:port`` of its weight relay (``weight_transport.relay_fanout``), ``None`` without one."""
    weight_upstreams: tuple[str, ...] = ()
    """Where its weights come from, nearest first (its parent relay, ..., the learner)."""


@dataclass(frozen=True, kw_only=True)
class RewardModelInfo(ServiceInfo):
    """``RewardModelActor.describe()``."""

    address: str
    """Its RewardModelService's ``host:port``."""
    models: dict = field(default_factory=dict)
    """``{model: reward version}`` of the reward models loaded now."""
    counts: dict = field(default_factory=dict)
    """Requests, batches and responses scored since it started, and models that failed to load."""
