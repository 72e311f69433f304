"""Loss-spike checkpoints: the checkpoint interval shortens for a while after the loss or gradient norm spikes
(the seeds' "checkpoint interval that shortens when the loss spikes"), so a run that goes on to diverge has a
recent checkpoint from just before.

A spike is an outlier by the Hampel identifier (Hampel 1974; the modified z-score of Iglewicz & Hoaglin 1993,
"How to Detect and Handle Outliers"): with ``m`` the median and ``MAD`` the median absolute deviation of the
metric's last ``window`` finite values, a value ``x`` spikes when ``x > m + factor * 1.4826 * MAD``
(``1.4826 * MAD`` estimates the standard deviation of normal data, robustly: a spike barely moves ``m`` or
``MAD``, so a run of spikes is still seen). Only upward moves count (a falling loss is no alarm), and the rule
works for a signed loss (a policy-gradient loss hovers around 0). Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field

log = structlog.get_logger("learner")

MAD_TO_STD = 1.4826
"""``1 / Phi^-1(3/4)``: ``MAD_TO_STD * MAD`` estimates the standard deviation of normally distributed data."""


class SpikeSaveConfig(BaseModel):
    """Shorten the checkpoint interval after a loss / grad-norm spike (``learner.spike_save``). Off by default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    """Watch ``metrics`` for spikes and shorten the save interval after one. Off: the interval is
    ``save_interval`` / ``save_schedule`` only, as without this block."""
    metrics: list[Literal["loss", "grad_norm"]] = Field(default_factory=lambda: ["loss", "grad_norm"], min_length=1)
    """The step metrics watched (each on its own window); a spike in any one counts."""
    window: int = Field(20, ge=3)
    """Steps of history per metric: the median and MAD are over the last ``window`` finite values, and nothing
    is flagged before the window is full (so the first ``window`` steps never spike)."""
    factor: float = Field(3.5, gt=0.0)
    """Threshold in robust standard deviations: ``x`` spikes when ``x > median + factor * 1.4826 * MAD``
    (3.5 is Iglewicz & Hoaglin's cut-off for the modified z-score). A window of identical values (``MAD``
    0) flags any rise above them."""
    interval_divisor: int = Field(2, ge=2)
    """During the hold, a checkpoint is due every ``max(1, interval // interval_divisor)`` steps, ``interval``
    being ``save_interval_at(step)`` (2: halved)."""
    hold_steps: int = Field(20, ge=1)
    """Steps the shortened interval lasts, counted from the spike's step (which is included); a spike during
    the hold restarts it."""


class SpikeDetector:
    """Watches each step's metrics, counts spikes and shortens the save interval for ``hold_steps`` steps after
    one. ``state_dict`` / ``load_state_dict`` carry it through checkpoints (JSON floats, exact).

    Args:
        config: the ``spike_save`` block; with ``enabled: false`` ``observe`` does nothing and ``interval``
            returns its input.
    """

    def __init__(self, config: SpikeSaveConfig) -> None:
        self.config = config
        self.history: dict[str, deque[float]] = {m: deque(maxlen=config.window) for m in config.metrics}
        """Last ``window`` finite values of each watched metric (floats)."""
        self.hold_until = -1
        """Last optimizer step (inclusive) of the current shortened interval; -1: none."""
        self.spikes = 0
        """Spikes seen so far (steps with at least one spiking metric)."""

    def observe(self, step: int, row: dict) -> dict[str, float]:
        """Feed optimizer step ``step``'s metrics row (``loss``, ``grad_norm``: floats; absent or non-finite
        values are skipped, not flagged). A spike is logged (``loss_spike``, with each spiking metric's value,
        median and threshold) and starts a hold through ``step + hold_steps - 1``.

        Returns:
            ``{}`` when disabled; else ``loss_spike`` (1.0 on a spike step, else 0.0) and ``loss_spikes`` (the
            running count), for the step's metrics row.
        """
        if not self.config.enabled:
            return {}
        spiking = {}
        for metric, values in self.history.items():
            x = row.get(metric)
            if not isinstance(x, (int, float)) or not math.isfinite(x):
                continue
            if len(values) == values.maxlen and x > (threshold := spike_threshold(values, self.config.factor)):
                spiking[metric] = {"value": float(x), "median": statistics.median(values), "threshold": threshold}
            values.append(float(x))
        if spiking:
            self.spikes += 1
            self.hold_until = step + self.config.hold_steps - 1
            log.warning("loss_spike", step=step, hold_until=self.hold_until, spikes=self.spikes, **spiking)
        return {"loss_spike": 1.0 if spiking else 0.0, "loss_spikes": float(self.spikes)}

    def interval(self, step: int, base: int) -> int:
        """The save interval at ``step``: ``max(1, base // interval_divisor)`` while a hold lasts, else ``base``
        (``LearnerLoopConfig.save_interval_at(step)``)."""
        if self.config.enabled and step <= self.hold_until:
            return max(1, base // self.config.interval_divisor)
        return base

    def state_dict(self) -> dict:
        """``{"history": {metric: [float]}, "hold_until": int, "spikes": int}``; ``{}`` when disabled."""
        if not self.config.enabled:
            return {}
        return {"history": {m: list(v) for m, v in self.history.items()}, "hold_until": self.hold_until,
                "spikes": self.spikes}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``'s output (``{}``, from a checkpoint without it: start empty). Metrics no longer
        watched are dropped; a shorter ``window`` keeps the newest values."""
        if not state or not self.config.enabled:
            return
        for metric, values in self.history.items():
            values.clear()
            values.extend(float(v) for v in state.get("history", {}).get(metric, []))
        self.hold_until, self.spikes = int(state.get("hold_until", -1)), int(state.get("spikes", 0))


def spike_threshold(values, factor: float) -> float:
    """``median + factor * 1.4826 * MAD`` of ``values`` (a non-empty sequence of floats): the Hampel identifier's
    upper bound (Iglewicz & Hoaglin 1993).

    Raises:
        statistics.StatisticsError: ``values`` is empty."""
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    return median + factor * MAD_TO_STD * mad
