"""How the supervisor creates services: each one a detached, named Ray actor built from the recipe.

Crash tests: the recipe's ``faults`` section arms fault points per incarnation — the i-th actor this factory
creates for a service name gets the i-th spec as ``GYRE_FAULT_POINT`` (``ServiceFactory.fault_env``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray

import faults
from services.actors import LearnerActor, ReplayActor
from services.rollout_actor import RolloutActor
from services.recipe import Recipe


ROLES = ("replay", "learner", "rollout")


def actor_name(run: str, service: str) -> str:
    """Ray actor name of a service: ``gyre:{run}:{service}`` (service: replay, learner, rollout-N, controller)."""
    return f"gyre:{run}:{service}"


@dataclass
class Service:
    """One supervised service instance."""

    name: str
    """``replay``, ``learner`` or ``rollout-{i}``."""
    role: str
    handle: ray.actor.ActorHandle
    address: str | None
    """gRPC address to health-check (replay's, the learner's WeightService); ``None`` for a rollout."""
    restarts: int = 0
    failures: int = 0
    """Consecutive failed health checks."""
    info: dict = field(default_factory=dict)
    """Last ``describe()`` answer (pid, node, version, gauges)."""


class ServiceFactory:
    """Creates (or re-attaches to) the detached, named service actors of one recipe."""

    def __init__(self, recipe: Recipe, env: dict, fingerprint: str) -> None:
        if recipe.placement.learner.world_size > 1:
            raise ValueError(f"placement.learner.world_size ({recipe.placement.learner.world_size}) > 1: the "
                             "controller starts single-rank learners only (multi-rank actors are not implemented)")
        self.recipe, self.env, self.fingerprint = recipe, env, fingerprint
        self.security = recipe.security.model_dump()
        out = recipe.out_dir.resolve()
        self.replay_dir = recipe.replay.dir or str(out / "replay")
        self.checkpoint_dir = out / "checkpoints"
        self.rollout_journal_dir = out / "rollouts"
        """Each rollout's run journal goes to ``{rollout_journal_dir}/rollout-{i}.jsonl`` (``gyre check``)."""
        self.incarnations: dict[str, int] = {}
        """Service name → actors created for it by this factory (re-attached ones do not count)."""

    def fault_env(self, service: str, incarnation: int) -> dict:
        """``env_vars`` of incarnation ``incarnation`` (0-based) of ``service``: ``self.env`` plus
        ``GYRE_FAULT_POINT`` when the recipe's ``faults[service]`` arms that incarnation (``faults``)."""
        specs = self.recipe.faults.get(service, [])
        spec = specs[incarnation] if incarnation < len(specs) else ""
        return {**self.env, faults.ENV: spec} if spec else dict(self.env)

    def _options(self, role: str, service: str, env: dict | None = None, **extra) -> dict:
        return {"name": actor_name(self.recipe.name, service), "namespace": self.recipe.ray.namespace,
                "lifetime": "detached", "runtime_env": {"env_vars": self.env if env is None else env},
                **getattr(self.recipe.placement, role).actor_options(), **extra}

    def attach(self, service: str) -> ray.actor.ActorHandle | None:
        """The live actor of ``service`` left by an earlier driver of this run, or ``None``."""
        try:
            return ray.get_actor(actor_name(self.recipe.name, service), namespace=self.recipe.ray.namespace)
        except ValueError:
            return None

    def _create(self, cls, role: str, service: str, *args, **kwargs) -> ray.actor.ActorHandle:
        """A new actor; retries while a killed predecessor still holds the name (``ray.kill`` is async)."""
        deadline = time.monotonic() + 60
        incarnation = self.incarnations.get(service, 0)
        self.incarnations[service] = incarnation + 1
        env = self.fault_env(service, incarnation)
        while True:
            try:
                opts = self._options(role, service, env, **({"max_concurrency": 4} if role == "learner" else {}))
                return cls.options(**opts).remote(*args, **kwargs)
            except ValueError as exc:
                if "already" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def replay(self) -> Service:
        handle = self._create(ReplayActor, "replay", "replay", self.recipe.replay.model_dump(),
                              dir=self.replay_dir, security=self.security, run_id=self.recipe.name)
        return Service("replay", "replay", handle, ray.get(handle.address.remote()))

    def learner(self, replay_address: str, restarted: bool = False) -> Service:
        cfg = self.recipe.learner.model_dump()
        cfg["fingerprint"] = cfg["fingerprint"] or self.fingerprint
        if restarted and any(self.checkpoint_dir.glob("global_step_*")):
            cfg["resume"] = "auto"  # a restarted learner rejoins from its own newest verified checkpoint
        handle = self._create(LearnerActor, "learner", "learner", cfg, replay_address,
                              checkpoint_dir=str(self.checkpoint_dir), security=self.security,
                              run_id=self.recipe.name)
        return Service("learner", "learner", handle, ray.get(handle.weights_address.remote()))

    def begin_rollout(self, index: int, replay_address: str, weights_address: str):
        """Create ``rollout-{index}`` and start its setup (vLLM start, weight subscription); returns
        ``(handle, setup ObjectRef)`` without waiting."""
        name = f"rollout-{index}"
        handle = self._create(RolloutActor, "rollout", name)
        return handle, handle.setup.remote(name, self.recipe.rollout.model_dump(), self.recipe.task.model_dump(),
                                           replay_address, weights_address, self.recipe.seed + index, self.security,
                                           run_id=self.recipe.name, journal_dir=str(self.rollout_journal_dir))

    def rollouts(self, indices: list[int], replay_address: str, weights_address: str) -> list[Service]:
        """Rollouts ``rollout-{i}`` for each index, set up concurrently (blocks until all are)."""
        started = [self.begin_rollout(i, replay_address, weights_address) for i in indices]
        ray.get([ref for _, ref in started])
        return [Service(f"rollout-{i}", "rollout", h, None) for i, (h, _) in zip(indices, started)]
