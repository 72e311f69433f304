"""Where a run's services go: the recipe's ``ray`` section (how the controller reaches Ray, the rollouts'
``runtime_env``) and ``placement`` section (resources and placement group per role)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gyre.services.common.cpus import parse_cpus


class RayConfig(BaseModel):
    """How the controller reaches Ray."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str = "local"
    """``"local"`` starts a private head in this process; ``"auto"`` or ``host:port`` joins a cluster."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs the private head advertises (``None``: all)."""
    namespace: str = "gyre"
    """Ray namespace of the run's named actors (``gyre:{run}:{service}``); the ops commands' ``--namespace``."""
    runtime_env: dict[str, Any] = {}
    """Ray ``runtime_env`` of the rollout actors, where reward functions are imported: e.g.
    ``{working_dir: ., py_modules: [rewards/]}`` ships a ``reward: {function: "pkg.module:fn"}``'s code to
    every node. A relative local ``working_dir`` / ``py_modules`` path is resolved from the working directory;
    gyre's own ``env_vars`` are added to (and win over) any given here. Checked by Ray when an actor starts."""


class RolePlacement(BaseModel):
    """Ray resources one service actor asks for (the seeds' device map, per role)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_cpus: float = Field(0, ge=0)
    """Logical CPUs reserved for the actor (0: it does not count against the CPU pool)."""
    num_gpus: float = Field(0, ge=0)
    """GPUs reserved for the actor (fractions share a GPU)."""
    resources: dict[str, float] = {}
    """Custom Ray resources, e.g. ``{"node_group_rollout": 1}`` to pin the role to a node group."""
    cpus: str | list[str] | None = None
    """The role's own CPU set on its node (cpuset list syntax: ``"0"``, ``"0-3,8"``; ``"N-"``: every core of the
    node from ``N`` on): its processes are bound to these cores and its torch/OpenMP threads number as many (``services.common.cpus``). A list gives one set per
    instance: rollout ``i`` gets entry ``i`` mod its length, learner rank ``r`` entry ``r``. ``None``: the OS
    schedules the role on any core (services sharing a node then share cores)."""

    @field_validator("cpus", mode="before")
    @classmethod
    def _cpu_ids_as_sets(cls, v):
        """``cpus: 1`` (YAML reads an int) is the set ``"1"``; likewise inside a list."""
        as_set = lambda x: str(x) if isinstance(x, int) and not isinstance(x, bool) else x  # noqa: E731
        return [as_set(x) for x in v] if isinstance(v, list) else as_set(v)

    @model_validator(mode="after")
    def _positive_resources(self) -> "RolePlacement":
        bad = {k: v for k, v in self.resources.items() if v <= 0 or not k}
        if bad:
            raise ValueError(f"resources {bad} must map non-empty names to amounts > 0")
        sets = [self.cpus] if isinstance(self.cpus, str) else list(self.cpus or [])
        if isinstance(self.cpus, list) and not sets:
            raise ValueError("cpus [] is empty; give a cpuset such as '0-3', one per instance, or leave cpus unset")
        for spec in sets:
            parse_cpus(spec)  # CpuSetError (a ValueError) names the bad set
        return self

    def cpus_for(self, index: int) -> str | None:
        """The CPU set of instance ``index`` (rollout number, learner rank; 0 for single services), or ``None``."""
        if self.cpus is None or isinstance(self.cpus, str):
            return self.cpus
        return self.cpus[index % len(self.cpus)]

    def actor_options(self) -> dict:
        """``ActorClass.options(**...)`` keys for this role."""
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                **({"resources": dict(self.resources)} if self.resources else {})}


class LearnerPlacement(RolePlacement):
    """The learner's resources per rank, and its world size (ranks reserved as one placement group)."""

    world_size: int = Field(1, ge=1)
    """DeepSpeed ranks; each rank gets one placement-group bundle of this role's resources."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = None
    """Placement-group strategy for the ranks; required when ``world_size > 1``."""

    @model_validator(mode="after")
    def _group_for_ranks(self) -> "LearnerPlacement":
        if self.world_size > 1 and self.strategy is None:
            raise ValueError(f"world_size {self.world_size} > 1 needs a placement group: set strategy to one of "
                             "PACK, SPREAD, STRICT_PACK, STRICT_SPREAD")
        return self

    def bundles(self) -> list[dict[str, float]]:
        """One placement-group bundle per rank: ``{"CPU": .., "GPU": .., **resources}`` (zero entries dropped)."""
        one = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return [{k: v for k, v in one.items() if v > 0} or {"CPU": 0.01} for _ in range(self.world_size)]


class RolloutPlacement(RolePlacement):
    """Each rollout's resources, and how many rollouts share one process."""

    rollouts_per_process: int = Field(1, ge=1)
    """Rollouts hosted per process (``services.rollout.host``): 1 (the default) gives each rollout its own Ray actor;
    ``M > 1`` runs rollout ``i`` in process ``i // M`` as an identity of its own (its own replay connection, prompt
    leases, weight subscription, spool and journal), so a fleet of hundreds of simulated rollouts fits a few cores
    (``bench.fleet``). Only with ``rollout.engine.kind: simulated``; the process takes this role's resources once."""


class PlacementConfig(BaseModel):
    """Where each role runs (``placement:`` in a recipe); an unknown role name is rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replay: RolePlacement = RolePlacement()
    """Resources of the replay service."""
    learner: LearnerPlacement = LearnerPlacement()
    """Resources of each learner rank, the world size and the placement-group strategy."""
    rollout: RolloutPlacement = RolloutPlacement()
    """Applies to every rollout service (each one gets these resources; with ``rollouts_per_process``, each process)."""
    reward_model: RolePlacement = RolePlacement()
    """Resources of the reward-model service (a GPU for a large reward model: ``num_gpus: 1``)."""
