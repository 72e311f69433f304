"""Policy-version timelines: which weights a version number names after the learner rewound.

A learner that crashes and resumes from an older checkpoint (step ``r``) trains versions ``r+1, r+2, …``
again, and outside lockstep they are not the weights its predecessor published under the same numbers
(different batches, nondeterministic kernels). So a version is named by ``(version, timeline)``:

- **timeline**: int64 id of the learner incarnation that published the version, drawn at random when the
  learner process starts (``new_timeline``). ``0`` (``SHARED``) means the number alone names the weights:
  version 0 (the initial model, the same in every incarnation), every version in lockstep (a re-written
  version must equal the lost one, ``proto.lockstep.VersionStore``), and a rollout's initial weights.
- **offer rule** (``is_new``): a rollout applies the learner's newest ``(v, t)`` when ``v`` is newer than its
  own version *or* ``t`` differs from its own timeline; so after a rewind it drops weights from the dead
  timeline and takes the learner's, even at a lower or equal number. The learner's publisher, the
  weight server, both transports and ``RolloutWorker.apply_weights`` all use this one rule.
- **data**: every trajectory records the timeline of the weights that sampled it (``policy_timeline``); a
  resumed learner's ``Rejoin`` names its timeline, replay retires the previous learner's and deletes (and from
  then on drops) its groups above the resumed version (``ReplayState.dead``); the learner counts such rows it
  still gets (``learner.step_metrics.dead_timeline_rows``).
"""

from __future__ import annotations

import secrets

SHARED = 0
"""Timeline of weights that the version number alone names (version 0, lockstep, initial weights)."""
UNKNOWN = -1
"""Timeline of weights whose origin is unknown (a rollout bootstrapped from an HF export on disk): the
learner's next offer replaces them whatever its number."""


def new_timeline(lockstep: bool) -> int:
    """A fresh learner incarnation's timeline: random in ``[1, 2**62]``; ``SHARED`` in lockstep."""
    return SHARED if lockstep else secrets.randbits(62) + 1


def label(version: int, timeline: int) -> int:
    """The timeline a learner on ``timeline`` publishes ``version`` under: ``SHARED`` for version 0."""
    return SHARED if version == 0 else timeline


def is_new(version: int, timeline: int, have_version: int, have_timeline: int) -> bool:
    """Whether a subscriber holding ``(have_version, have_timeline)`` should take the offered
    ``(version, timeline)``: a newer version, or any version of another timeline (the learner rewound)."""
    return version > have_version or timeline != have_timeline
