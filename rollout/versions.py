"""Where the policy version a group is generated with comes from: the seam between the rollout worker (and
its actor) and the run's determinism mode.

``version_source(config)`` picks the implementation once, from ``RolloutConfig.lockstep``:

- ``StreamedVersions`` (asynchronous RL, the default): the learner's streamed versions are applied in flight
  (``RolloutWorker.apply_weights``, timelines as in ``proto.timeline``); a group is generated with whatever the
  engine serves; leases are unbounded; evaluation scores the weights the engine has.
- ``LockstepVersions`` (``determinism: lockstep``, ``proto.lockstep``): streamed versions are only noted;
  each prompt is generated with exactly its version, loaded from the version store by a ``LockstepGate``;
  leases stop below the first prompt whose version is not published; evaluation holds the newest offered
  version.

The worker and the rollout actor call only these methods, never ``config.lockstep``.
"""

from __future__ import annotations

import contextlib
import zlib
from abc import ABC, abstractmethod
from typing import AsyncContextManager, Awaitable, Callable, TypeVar

from gyre.proto.lockstep import LockstepConfig
from gyre.rollout.config import RolloutConfig
from gyre.rollout.lockstep_gate import LockstepGate

T = TypeVar("T")


class VersionSource(ABC):
    """Contract: where the policy version of a generated group comes from (one per rollout worker).

    ``bind(engine)`` once, before any other method but ``initial_engine_version``. Methods that read
    versions return policy version numbers (``int``, ``-1``: none yet); none of them raises unless the
    engine or the version store does.
    """

    initial_engine_version: int = 0
    """The version the engine starts at (``RolloutEngine.start(initial_version=)``)."""

    def __init__(self) -> None:
        self.engine = None

    def bind(self, engine) -> VersionSource:
        """Use ``engine`` (a started ``rollout.engine.RolloutEngine`` or a test double); returns ``self``."""
        self.engine = engine
        return self

    def load_s(self) -> float:
        """Seconds this source itself spent loading weights into the engine (lockstep's gate); 0.0 when every
        load goes through ``RolloutWorker.apply_weights`` (streamed versions)."""
        return 0.0

    @abstractmethod
    def offer(self, version: int) -> bool:
        """The learner streamed ``version``: note it; True when the worker should apply the streamed
        weights in flight, False when they are not used (each prompt loads its own version)."""

    @abstractmethod
    def served(self) -> int:
        """The policy version this rollout serves (what it reports, journals and binds to its logs)."""

    @abstractmethod
    def serves(self, version: int, timeline: int, engine_timeline: int) -> bool:
        """Whether the rollout serves ``version`` (or newer) of the learner's ``timeline``; ``engine_timeline``
        is the timeline of the weights the engine holds (``RolloutWorker.timeline``)."""

    @abstractmethod
    def lease_args(self) -> tuple | None:
        """Extra positional arguments of ``ReplaySink.lease_prompts`` after ``(consumer, count)`` (``()``:
        unbounded), or None when no prompt may be leased now."""

    @abstractmethod
    def generating(self, prompt_index: int) -> AsyncContextManager[None]:
        """Held while prompt ``prompt_index``'s group is generated: the engine serves its version meanwhile."""

    @abstractmethod
    def sampling_seed(self, prompt_index: int, group_id: str, base_seed: int) -> int:
        """The sampling seed (uint32) of the group ``group_id`` of prompt ``prompt_index`` (sample j adds j)."""

    @abstractmethod
    def evaluating(self) -> AsyncContextManager[None]:
        """Held while an evaluation generates: the engine serves ``served()`` meanwhile."""

    @abstractmethod
    async def first_subscription(self, subscriber, catch_up: Callable[[], Awaitable[T]],
                                 skipped: Callable[[int, str, int | None], T]) -> T:
        """Start ``subscriber`` (a weight transport) for the first time: either ``await catch_up()`` (it
        starts the subscriber and reaches the learner's newest version) or start it and return
        ``skipped(engine_version, source, learner_latest)``."""


class StreamedVersions(VersionSource):
    """Asynchronous RL: the learner's streamed versions are applied in flight; see the module docstring."""

    def offer(self, version: int) -> bool:
        return True

    def served(self) -> int:
        return self.engine.version

    def serves(self, version: int, timeline: int, engine_timeline: int) -> bool:
        return self.engine.version >= version and engine_timeline == timeline

    def lease_args(self) -> tuple | None:
        return ()

    def generating(self, prompt_index: int) -> AsyncContextManager[None]:
        return contextlib.nullcontext()

    def sampling_seed(self, prompt_index: int, group_id: str, base_seed: int) -> int:
        return zlib.crc32(f"{base_seed}-{group_id}".encode())

    def evaluating(self) -> AsyncContextManager[None]:
        return contextlib.nullcontext()

    async def first_subscription(self, subscriber, catch_up, skipped):
        return await catch_up()


class LockstepVersions(VersionSource):
    """Lockstep: each prompt's exact version from the version store (``LockstepGate``); see the module
    docstring. ``config``: the run's lockstep settings."""

    initial_engine_version = -1  # version 0 too comes from the version store: every load takes one path

    def __init__(self, config: LockstepConfig) -> None:
        super().__init__()
        self.config = config
        self.gate: LockstepGate | None = None
        self.newest_offered = -1
        """Newest policy version the learner streamed (noted, never applied directly)."""

    def bind(self, engine) -> VersionSource:
        super().bind(engine)
        self.gate = LockstepGate(engine, self.config)
        return self

    def offer(self, version: int) -> bool:
        self.newest_offered = max(self.newest_offered, version)
        return False

    def load_s(self) -> float:
        """The gate's weight loads (``LockstepGate.load_s``)."""
        return self.gate.load_s if self.gate is not None else 0.0

    def served(self) -> int:
        """The newest offered version (the engine stays at -1 until a prompt loads its own)."""
        return max(self.engine.version, self.newest_offered)

    def serves(self, version: int, timeline: int, engine_timeline: int) -> bool:
        """Whether ``version`` was offered (lockstep runs have one timeline)."""
        return self.newest_offered >= version

    def lease_args(self) -> tuple | None:
        """Only prompts whose exact policy version is already published: ``(ttl_s=0.0, below=...)``."""
        below = (self.newest_offered + self.config.lag + 1) * self.config.groups_per_step
        return None if below <= 0 else (0.0, below)

    def generating(self, prompt_index: int) -> AsyncContextManager[None]:
        return self.gate.hold(self.config.version_for(prompt_index))

    def sampling_seed(self, prompt_index: int, group_id: str, base_seed: int) -> int:
        """``LockstepConfig.seed_for``: shared by every attempt and rollout of the prompt."""
        return self.config.seed_for(prompt_index)

    def evaluating(self) -> AsyncContextManager[None]:
        """Hold the newest offered version, and version 0 before any offer (the evaluation before training): the
        engine's own -1 is the model folder's weights, which are no published version."""
        return self.gate.hold(max(0, self.served()))

    async def first_subscription(self, subscriber, catch_up, skipped):
        """Nothing to catch up to: each prompt loads its exact version from the version store."""
        subscriber.start()
        return skipped(self.engine.version, "lockstep", None)


def version_source(config: RolloutConfig) -> VersionSource:
    """The ``VersionSource`` of a rollout configured by ``config`` (unbound: call ``bind(engine)``)."""
    return StreamedVersions() if config.lockstep is None else LockstepVersions(config.lockstep)
