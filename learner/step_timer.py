"""Where a learner step's wall time goes: named phases that sum exactly to the step (``time/learner/*`` keys of
its metrics row). Pure, no torch: the GPU synchronisation that makes the forward/backward vs optimizer split honest
is the engine's (``learner.engine.LearnerEngine._update``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

PREFIX = "time/learner/"
"""Prefix of the learner's phase keys in a metrics row (``time/learner/wait_data_s``, ...)."""

PHASES = ("wait_data", "forward_backward", "optimizer", "checkpoint", "publish_blocking")
"""The named phases of a learner step, in the order a step runs them (``other`` is the rest):

- ``wait_data``: leasing the batch from replay until it is there (the first step after a start also
  ``Rejoin``s replay here);
- ``forward_backward``: the engine's ``train_step`` call minus ``optimizer`` — forward and backward passes, the
  no-grad passes (GAE values, proximal logprobs, reference model), per-step metric reduction and, with several
  ranks, handing the batch to them;
- ``optimizer``: the engine's ``optimizer_step_s`` (DeepSpeed ``engine.step()``, summed over the step's updates);
- ``checkpoint``: the seconds a checkpoint blocked the step (0 when none was due; with ``async_save`` only the
  capture, the background write is not on the step's clock);
- ``publish_blocking``: capturing the new weights on their device (``learner.weight_capture``) and queueing them
  for the background publisher (``learner.background_publish``: host copy, checksums and serving run behind the
  next steps; lockstep waits for them here)."""


class StepTimer:
    """Wall seconds of one learner step split into ``PHASES``, measured with ``time.perf_counter``.

    Created when the step starts; ``phase(name)`` times a block into ``name``; ``row()`` ends the step and answers
    the ``time/learner/*`` keys, where ``other_s`` is the step's wall time minus the named phases (building the
    batch, spike detection, polling a background save, ...), so the phases sum to ``step_s`` exactly.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        """Phase name → seconds so far."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the wall seconds of the ``with`` block to phase ``name`` (also when it raises).

        Raises:
            KeyError: ``name`` is not one of ``PHASES``.
        """
        if name not in self.seconds:
            raise KeyError(f"unknown learner step phase {name!r}; expected one of {PHASES}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def move(self, source: str, target: str, seconds: float) -> None:
        """Re-attribute ``seconds`` that a callee measured inside ``source`` (the engine's ``optimizer_step_s``
        inside its ``train_step``) to ``target``; at most what ``source`` holds, so no phase goes negative."""
        moved = min(max(float(seconds), 0.0), self.seconds[source])
        self.seconds[source] -= moved
        self.seconds[target] += moved

    def row(self) -> dict[str, float]:
        """End the step: ``time/learner/{phase}_s`` for every phase, ``time/learner/other_s`` and
        ``time/learner/step_s`` (the step's wall seconds, the sum of all the others)."""
        step_s = time.perf_counter() - self.start
        named = {f"{PREFIX}{name}_s": s for name, s in self.seconds.items()}
        return {**named, f"{PREFIX}other_s": step_s - sum(self.seconds.values()), f"{PREFIX}step_s": step_s}
