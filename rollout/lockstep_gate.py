"""The rollout side of lockstep (``proto.lockstep``): generate each prompt with exactly its policy version.

One vLLM engine holds one set of weights, so groups that need the same version run concurrently and a
group that needs another waits until the engine is idle, then the gate loads that version from the
``VersionStore`` (waiting until the learner has written it). Requests are served first come, first served,
so a switch is never starved by a stream of groups of the current version; a group whose version the
learner has not written yet waits outside that queue, so it holds up nobody. Leases arrive in prompt order,
so versions mostly rise; a re-issued old prompt (its first rollout crashed) rewinds the engine once.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from contextlib import asynccontextmanager

import structlog

from gyre.faults import fault_point
from gyre.proto.lockstep import LockstepConfig, VersionStore

log = structlog.get_logger("rollout")


class LockstepGate:
    """Holds ``engine`` at the exact policy version each generation needs.

    Args:
        engine: a started ``rollout.engine.RolloutEngine`` (``version``, ``update_weights(v, tensors, rewind=)``).
        config: the run's lockstep settings (``weights_dir`` is read with a ``VersionStore``).
        poll_s: seconds between looks for a version the learner has not written yet.
    """

    def __init__(self, engine, config: LockstepConfig, poll_s: float = 0.2) -> None:
        self.engine, self.config, self.poll_s = engine, config, poll_s
        self.store = VersionStore(config.weights_dir, keep=config.lag + 2)
        self._cond = asyncio.Condition()
        self._holders = 0
        self._queue: deque[int] = deque()
        self._tickets = itertools.count()
        self.switches = 0
        """Weight loads the gate made (each version change, rewinds included)."""
        self.rewinds = 0
        """Loads of a version older than the engine's (a re-issued prompt)."""
        self.load_s = 0.0
        """Seconds the engine spent in those loads (``engine.update_weights``: paused, loading), summed."""

    @asynccontextmanager
    async def hold(self, version: int):
        """Run the body with the engine at exactly ``version``; others needing it may share the engine."""
        if self.engine.version != version:  # wait outside the queue: an unwritten version blocks nobody
            await self._await_written(version)
        ticket = next(self._tickets)
        async with self._cond:
            self._queue.append(ticket)
            try:
                await self._cond.wait_for(lambda: self._queue[0] == ticket and (
                    self.engine.version == version or self._holders == 0))
                if self.engine.version != version:
                    await self._load(version)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
            self._holders += 1
        try:
            yield
        finally:
            async with self._cond:
                self._holders -= 1
                self._cond.notify_all()

    async def _await_written(self, version: int) -> None:
        """Wait until the learner has written ``version`` to the store (warns once after 60 s)."""
        waited = 0.0
        while not self.store.path(version).is_file():
            if waited >= 60.0 and waited - self.poll_s < 60.0:
                log.warning("lockstep_version_awaited", version=version, waited_s=waited,
                            stored=self.store.versions()[-4:])
            await asyncio.sleep(self.poll_s)
            waited += self.poll_s

    async def _load(self, version: int) -> None:
        """Read ``version`` from the store (waiting if it is being re-written) and load it, older or newer."""
        tensors = await asyncio.to_thread(self.store.read, version)
        while tensors is None:
            await self._await_written(version)
            tensors = await asyncio.to_thread(self.store.read, version)
        rewind = version < self.engine.version
        fault_point("rollout.apply_weights")
        seconds = await self.engine.update_weights(version, tensors, rewind=rewind)
        self.switches += 1
        self.rewinds += rewind
        self.load_s += seconds
        log.info("lockstep_version_loaded", version=version, rewind=rewind, seconds=round(seconds, 3))
