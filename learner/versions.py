"""What the learner does with the policy versions it publishes: the seam between the learner loop and the run's
determinism mode (the learner's half of ``rollout.versions``).

``learner_versions(config)`` picks the implementation once, from ``LearnerLoopConfig.lockstep``:

- ``StreamedPublishing`` (asynchronous RL, the default): every learner incarnation publishes on a fresh random
  timeline (``proto.timeline``), so rollouts drop a crashed predecessor's versions; a step leases whichever
  groups replay offers; nothing is written to disk.
- ``LockstepPublishing`` (``determinism: lockstep``, ``proto.lockstep``): one shared timeline; step ``s``
  leases exactly the groups of prompts ``[s·P, (s+1)·P)``; every published version is also written to the
  ``VersionStore`` (rollouts load exact versions from it), and on (re)start the versions a predecessor wrote
  above the starting one are set aside until re-written with matching hashes.

The loop (``learner.loop.LearnerLoop``) calls only these methods, never ``config.lockstep``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import structlog
import torch

from gyre.learner.loop_config import LearnerLoopConfig
from gyre.proto.lockstep import LockstepConfig, VersionStore, deterministic_kernels
from gyre.proto.timeline import new_timeline

log = structlog.get_logger()


class LearnerVersions(ABC):
    """Contract: what happens around each policy version a learner publishes (one per learner incarnation).

    ``timeline`` is this incarnation's timeline (``proto.timeline``): every version it publishes but 0
    carries it.
    """

    timeline: int
    publish_in_background: bool = True
    """Whether a step may go on while its version is published (``learner.background_publish``); lockstep waits,
    so a version that disagrees with its stored predecessor stops the step that made it."""

    @staticmethod
    def prepare_process() -> None:
        """Process-wide settings a learner rank needs before its engine is built (before CUDA starts)."""

    @abstractmethod
    def sample_args(self, step: int) -> dict:
        """Extra keyword arguments of ``ReplaySource.sample`` for optimizer step ``step`` (``{}``: any groups)."""

    @abstractmethod
    def published(self, version: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """Called with each version's weights (HF names → tensors) just before they are published.

        Raises:
            proto.lockstep.VersionMismatchError: lockstep, and ``version`` was stored before with other weights.
        """

    @abstractmethod
    def starting_at(self, version: int) -> list[int]:
        """The learner (re)starts at ``version`` (cold start or resume); returns the versions set aside."""


class StreamedPublishing(LearnerVersions):
    """Asynchronous RL: a fresh random timeline; no lease bounds; nothing stored."""

    def __init__(self) -> None:
        self.timeline = new_timeline(lockstep=False)

    def sample_args(self, step: int) -> dict:
        return {}

    def published(self, version: int, named: list[tuple[str, torch.Tensor]]) -> None:
        pass

    def starting_at(self, version: int) -> list[int]:
        return []


class LockstepPublishing(LearnerVersions):
    """Deterministic mode: the shared timeline, exact prompt ranges per step, every version in the store.

    The store keeps ``lag + 2`` versions: the ``lag + 1`` a re-issued prompt may still need, plus the newest.
    """

    publish_in_background = False

    def __init__(self, config: LockstepConfig) -> None:
        self.config = config
        self.timeline = new_timeline(lockstep=True)
        self.store = VersionStore(config.weights_dir, keep=config.lag + 2)

    @staticmethod
    def prepare_process() -> None:
        """Deterministic kernels (``proto.lockstep.deterministic_kernels``), without which a resumed learner
        cannot re-produce the lost versions bit for bit. Raises what ``deterministic_kernels`` raises."""
        deterministic_kernels()

    def sample_args(self, step: int) -> dict:
        return {"prompt_indices": self.config.prompts_of_step(step)}

    def published(self, version: int, named: list[tuple[str, torch.Tensor]]) -> None:
        self.store.write(version, named)

    def starting_at(self, version: int) -> list[int]:
        """Versions a predecessor wrote above ``version`` are set aside, so no rollout loads them until this
        learner re-wrote each one and its hash matched (``VersionStore.set_aside_after``)."""
        moved = self.store.set_aside_after(version)
        if moved:
            log.warning("lockstep_versions_set_aside", start_version=version, versions=moved)
        return moved


def learner_versions(config: LearnerLoopConfig) -> LearnerVersions:
    """The implementation ``config.lockstep`` selects (``LockstepPublishing`` when set)."""
    return LockstepPublishing(config.lockstep) if config.lockstep is not None else StreamedPublishing()


def prepare_learner_process(config: LearnerLoopConfig) -> None:
    """Process-wide settings a learner rank needs before its engine is built (before CUDA starts): in lockstep,
    deterministic kernels. Nothing otherwise. Raises what ``deterministic_kernels`` raises."""
    (LockstepPublishing if config.lockstep is not None else StreamedPublishing).prepare_process()
