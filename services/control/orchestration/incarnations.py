"""The supervisor's records of incarnations: a death it handled (``Death``) and a rollout replacement or addition that is
still starting (``Starting``). A rollout being removed is ``drains.Draining``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray

from gyre.services.common.names import ServiceName


@dataclass(frozen=True)
class Death:
    """One death the supervisor handled: the incarnation it ended and why. Every death handled creates exactly
    one replacement, so a service's ``restarts`` is the number of its deaths, and a crash test compares the list
    with the fault points' fire log (``faults.read_fire_log``: service, incarnation, point)."""

    service: str
    """Service name (``replay``, ``learner``, ``rollout-{i}``, ``reward_model``)."""
    incarnation: int
    """0-based incarnation that ended (``ServiceFactory.newest`` when it was created)."""
    reason: str
    """Why: ``dead``, ``N failed health checks``, ``requested``, ``died while starting``, ..."""

    def to_dict(self) -> dict:
        return {"service": self.service, "incarnation": self.incarnation, "reason": self.reason}


@dataclass
class Starting:
    """A rollout added by ``scale`` (or replacing a failed one) that is not generating yet."""

    id: ServiceName
    handle: ray.actor.ActorHandle
    setup: ray.ObjectRef | None
    """Its ``setup`` call; ``None`` once it returned."""
    target_version: int = 0
    """Policy version it must hold before it generates (the learner's when setup returned)."""
    restarts: int = 0
    """Restarts of this rollout once it joins (a restart's replacement: the old count + 1)."""
    swaps: int = 0
    """Reward swaps in force when it was created (``RewardSwaps.count``): it joins with the newer ones applied."""
    incarnation: int = 0
    """Its incarnation (``ServiceFactory.newest`` right after it was created)."""
    since: float = field(default_factory=time.monotonic)
    """When it was created (``time.monotonic``): one not started within the supervisor's ``start_timeout_s`` (Ray
    could not place it, or its setup hangs) is given up."""

