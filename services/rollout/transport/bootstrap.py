"""Start a rollout on the newest policy version: from the learner if it answers in time, else from disk.

``await bootstrap(engine, transport, config)`` runs after the engine started and before the worker
generates (``RolloutActor.setup``). It starts the transport, waits up to ``config.bootstrap_wait_s``
seconds for the engine to reach the learner's newest version, and if that does not happen (learner
unreachable or too slow) loads the newest HF export under ``config.bootstrap_dir`` and says so loudly.
The transport keeps running either way, so the rollout catches up once the learner answers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from gyre.proto.exports import load_export, newest_export
from gyre.rollout.config import EngineConfig
from gyre.services.rollout.transport.base import WeightTransport

log = structlog.get_logger("weights")
@dataclass(frozen=True)
class BootstrapResult:
    """Where the rollout's first policy version came from."""

    version: int
    source: str
    """``"learner"`` (caught up), ``"disk"`` (an export under ``bootstrap_dir``), ``"initial"``, or ``"lockstep"``
    (no catch-up: each prompt loads its exact version from the version store)."""
    learner_latest: int | None
    """The learner's newest version when the wait ended; ``None``: it never answered."""
    path: str | None = None
    """The export folder loaded when ``source == "disk"``."""


async def _wait_for_learner(engine, transport: WeightTransport, wait_s: float) -> int | None:
    """Poll ``Latest`` until the engine serves it (or nothing is published); the last answer or ``None``."""
    deadline = time.monotonic() + wait_s
    latest = None
    while True:
        remaining = deadline - time.monotonic()
        answer = await asyncio.to_thread(transport.latest_version, max(0.1, min(2.0, remaining)))
        latest = answer if answer is not None else latest
        if answer is not None and (answer < 0 or engine.version >= answer):
            return answer
        if time.monotonic() >= deadline:
            return latest
        await asyncio.sleep(0.2)


async def bootstrap(engine, transport: WeightTransport, config: EngineConfig) -> BootstrapResult:
    """Start ``transport`` and bring ``engine`` to the newest policy version before generation starts.

    ``engine`` is a ``rollout.engine.RolloutEngine`` whose ``update_weights`` is what the transport's
    ``on_version`` calls. Waits at most ``config.bootstrap_wait_s`` seconds (plus one disk load).

    Raises:
        ValueError: a malformed ``gyre_version.json`` under ``bootstrap_dir``.
    """
    initial = engine.version
    transport.start()
    latest = await _wait_for_learner(engine, transport, config.bootstrap_wait_s)
    if latest is not None and engine.version >= latest >= 0:
        log.info("bootstrap_caught_up", version=engine.version, source="learner")
        return BootstrapResult(engine.version, "learner", latest)
    disk = newest_export(Path(config.bootstrap_dir)) if config.bootstrap_dir else None
    if disk is not None and disk[0] > engine.version:
        from gyre.rollout.engine import StaleVersionError

        version, folder = disk
        try:
            await engine.update_weights(version, await asyncio.to_thread(load_export, folder))
        except StaleVersionError:  # the learner's version arrived meanwhile: it is newer
            return BootstrapResult(engine.version, "learner", latest)
        log.warning("BOOTSTRAP_FROM_DISK: learner unreachable or behind; rollout runs the on-disk export",
                    version=version, path=str(folder), learner_latest=latest, waited_s=config.bootstrap_wait_s)
        return BootstrapResult(version, "disk", latest, str(folder))
    if engine.version > initial:
        return BootstrapResult(engine.version, "learner", latest)
    if engine.version < 0:  # random weights (load_format: dummy): never generate on them
        return await _wait_for_a_version(engine, transport, config, latest)
    level = log.error if latest is not None and latest > engine.version else log.warning
    level("BOOTSTRAP_COLD_START: no newer policy version could be loaded; rollout runs the initial weights",
          version=engine.version, learner_latest=latest, bootstrap_dir=config.bootstrap_dir,
          waited_s=config.bootstrap_wait_s)
    return BootstrapResult(engine.version, "initial", latest)


async def _wait_for_a_version(engine, transport: WeightTransport, config: EngineConfig,
                              latest: int | None) -> BootstrapResult:
    """The engine holds no policy version (``load_format: dummy``) and neither the learner nor ``bootstrap_dir`` gave
    one within ``bootstrap_wait_s``: keep waiting for the transport's first version, saying so every period (the
    supervisor's start timeout ends a rollout that never gets one)."""
    period, waited = max(config.bootstrap_wait_s, 5.0), config.bootstrap_wait_s
    while engine.version < 0:
        log.warning("bootstrap_waits_for_first_version", waited_s=round(waited), learner_latest=latest,
                    reason="load_format dummy: the engine's random weights are no policy version")
        t0 = time.monotonic()
        answer = await _wait_for_learner(engine, transport, period)
        latest = answer if answer is not None else latest
        if engine.version < 0:  # nothing published yet (answer -1) returns at once: do not spin
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
        waited += time.monotonic() - t0
    return BootstrapResult(engine.version, "learner", latest)
