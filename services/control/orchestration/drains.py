"""Rollouts removed by ``scale``, finished in the background while the supervisor keeps ticking: ``drain`` (the rollout
leases no more prompts; the groups it holds leases for are finished and delivered), then ``stop`` (its engine shuts
down), then ``ray.kill``. A blocking drain held the supervisor, its health checks and metrics, up to 150 s per rollout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
import structlog
from ray.exceptions import GetTimeoutError, RayActorError

from gyre.services.rollout.host import kill_service

log = structlog.get_logger("supervisor")

DRAIN_S = 120.0
"""Seconds a removed rollout may take to finish and deliver the groups it holds prompt leases for (any left are
re-issued after ``prompt_lease_ttl_s``)."""
STOP_S = 120.0
"""Seconds its ``stop`` (engine shutdown) may take before it is killed anyway."""


@dataclass
class Draining:
    """A rollout being removed: its ``drain`` or ``stop`` call in flight."""

    name: str
    index: int
    """Its rollout index: the name stays taken until the actor is killed."""
    handle: ray.actor.ActorHandle
    call: ray.ObjectRef
    """The ``drain`` or ``stop`` call in flight."""
    phase: str
    """``drain`` or ``stop``."""
    deadline: float
    """``time.monotonic`` past which the phase is given up (the actor is killed either way at the end)."""


def begin_drain(draining: dict[str, Draining], svc, generating: bool, drain_s: float = DRAIN_S) -> None:
    """Start removing rollout ``svc`` (a ``Service`` already out of the fleet): ``drain`` while the fleet generates,
    else straight to ``stop``; recorded in ``draining`` by name."""
    call, phase = (svc.handle.drain.remote(drain_s), "drain") if generating else (svc.handle.stop.remote(), "stop")
    draining[svc.name] = Draining(svc.name, svc.id.index, svc.handle, call, phase,
                                  time.monotonic() + (drain_s if phase == "drain" else STOP_S) + 30)
    log.info("rollout_draining", service=svc.name, phase=phase)


def advance_drains(draining: dict[str, Draining]) -> None:
    """Move each rollout in ``draining`` one phase on when its call returned or its deadline passed: drain → stop →
    killed (and removed from ``draining``). Never waits."""
    for name, d in list(draining.items()):
        late = time.monotonic() > d.deadline
        if not late and not ray.wait([d.call], timeout=0)[0]:
            continue
        try:
            result = None if late else ray.get(d.call)
        except (RayActorError, GetTimeoutError) as exc:
            log.warning("rollout_stop_failed", service=name, phase=d.phase, error=str(exc)[:200])
            result = None
        if late:
            log.warning("rollout_drain_late", service=name, phase=d.phase)
        if d.phase == "drain" and not late:
            log.info("rollout_drained", service=name, undelivered_prompt_leases=result)
            d.call, d.phase, d.deadline = d.handle.stop.remote(), "stop", time.monotonic() + STOP_S
            continue
        kill_service(d.handle, ray)
        del draining[name]
        log.info("rollout_removed", service=name)
