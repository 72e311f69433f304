"""Rollout time per learner step: the fleet's cumulative phase seconds (``RolloutStats.as_dict``'s ``generate_s``,
``score_s``, ``insert_s``, ``weight_apply_s``) turned into the ``time/rollout/*`` deltas of the controller's
metrics rows. Pure: the controller hands in what the supervisor last described."""

from __future__ import annotations

from gyre.rollout.stats import ROLLOUT_PHASES

PREFIX = "time/rollout/"
"""Prefix of the rollout phase keys in a metrics row (``time/rollout/generate_s``, ...)."""


class RolloutTimeDeltas:
    """Remembers each rollout's cumulative phase seconds as last taken, so ``take`` answers what the fleet
    added since.

    A rollout's phase seconds are wall seconds during which at least one of its groups was in that phase
    (``rollout.stats.BusyClock``): its phases overlap (one group generates while another is inserted), so they
    do not add up to its wall time, but none runs faster than the wall clock. ``take`` sums them over rollouts:
    with ``N`` rollouts a phase can reach ``N`` times the wall time that passed.
    """

    def __init__(self) -> None:
        self._seen: dict[str, dict[str, float]] = {}
        """Rollout name → phase → cumulative seconds at the previous ``take``."""

    def take(self, stats: dict[str, dict]) -> dict[str, float]:
        """Seconds each phase gained since the previous ``take``, summed over rollouts, as
        ``{"time/rollout/{phase}_s": seconds}``.

        Args:
            stats: rollout name → its ``RolloutStats.as_dict``. A rollout seen for the first time, or whose
                counter went down (restarted: its new worker counts from 0), counts from 0; a rollout without
                a phase's key (an older worker) adds nothing to it; a rollout missing from one ``take`` (not
                described that round) keeps its last counters.
        """
        totals = dict.fromkeys(ROLLOUT_PHASES, 0.0)
        for name, st in stats.items():
            before, now = self._seen.get(name, {}), {}
            for phase in ROLLOUT_PHASES:
                value = st.get(f"{phase}_s")
                if not isinstance(value, (int, float)):
                    continue
                now[phase] = float(value)
                prev = before.get(phase, 0.0)
                totals[phase] += now[phase] - prev if now[phase] >= prev else now[phase]
            self._seen[name] = {**before, **now}
        return {f"{PREFIX}{phase}_s": s for phase, s in totals.items()}


def spread(deltas: dict[str, float], rows: int) -> dict[str, float]:
    """``deltas`` shared evenly by ``rows`` metrics rows written together (the controller polls the learner about
    once a second, and a poll may bring several steps); ``{}`` for no rows."""
    return {key: s / rows for key, s in deltas.items()} if rows > 0 else {}
