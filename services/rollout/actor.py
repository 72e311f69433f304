"""The rollout service as its own Ray actor (async, one process per rollout): ``services.rollout.service.RolloutService``."""

from __future__ import annotations

import ray

from gyre.services.rollout.service import RolloutService

RolloutActor = ray.remote(RolloutService)
"""A rollout service in its own process: ``RolloutService`` as a Ray actor."""
