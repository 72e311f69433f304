"""The KL coefficient's controller: ``fixed`` (``kl_coef`` throughout) or ``adaptive`` (Ziegler et al. 2019,
"Fine-Tuning Language Models from Human Preferences", §2.2: the coefficient is steered so that the observed KL
to the reference tracks ``target_kl``; verl's ``algorithm.kl_ctrl: {type: adaptive, kl_coef, target_kl,
horizon}``, TRL's ``AdaptiveKLController``).

Pure Python floats, no torch: the update is the same on every rank and its state is two JSON numbers, saved in
the learner checkpoint's metadata (``learner.checkpoint.store.CheckpointMetadata.kl_ctrl``), so a resumed run
continues with the exact coefficient.
"""

from __future__ import annotations

import math
from typing import Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field

log = structlog.get_logger("learner")

KL_ERROR_CLIP = 0.2
"""Bound of the proportional error ``e = clip(KL / target_kl - 1, -0.2, 0.2)`` (Ziegler et al. 2019, §2.2)."""


class KLControlConfig(BaseModel):
    """How the KL coefficient ``beta`` moves during training (``learner.algorithm.kl_ctrl``). Its initial value is
    ``learner.algorithm.kl_coef`` either way."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["fixed", "adaptive"] = "fixed"
    """``fixed``: ``beta = kl_coef`` at every step (the default). ``adaptive``: after every optimizer step (every
    sampled batch of ``n`` trajectories), ``e = clip(kl_to_ref / target_kl - 1, -0.2, 0.2)`` and ``beta *= 1 + e *
    n / horizon`` (Ziegler et al. 2019, §2.2; verl's ``AdaptiveKLController``), ``kl_to_ref`` being the step's
    token-mean k3 estimate of ``KL(pi || pi_ref)``. Needs ``kl_coef > 0`` (the reference model is loaded only
    then). The coefficient in use is the ``kl_coef`` metric of each step."""

    target_kl: float = Field(0.1, gt=0.0)
    """``adaptive`` only: the KL to the reference (nats per token, the ``kl_to_ref`` metric) the controller steers
    toward: above it ``beta`` grows, below it ``beta`` shrinks, by at most 20% per ``horizon`` trajectories. verl's
    default is 0.1."""

    horizon: int = Field(10000, ge=1)
    """``adaptive`` only: trajectories over which a full 20% proportional error changes ``beta`` by 20%
    (Ziegler et al. 2019 use 10000, verl's default). A recipe refuses a horizon of at most ``0.2 *`` the batch's
    trajectories, which could make ``beta`` negative in one step."""


def check_kl_ctrl(kl_ctrl: KLControlConfig, kl_coef: float) -> None:
    """Refuse an adaptive controller without a reference model.

    Raises:
        ValueError: ``kl_ctrl.type`` is ``adaptive`` and ``kl_coef`` is not > 0 (it names the value)."""
    if kl_ctrl.type == "adaptive" and not kl_coef > 0:
        raise ValueError(f"kl_ctrl.type 'adaptive' needs kl_coef > 0 (its initial value; the reference model is "
                         f"loaded only then); got kl_coef {kl_coef}")


def check_horizon(kl_ctrl: KLControlConfig, trajectories: int) -> None:
    """Refuse a horizon so short that one step of ``trajectories`` at the smallest error (-0.2) would make the
    multiplier ``1 - 0.2 * trajectories / horizon`` zero or negative.

    Raises:
        ValueError: adaptive and ``horizon <= 0.2 * trajectories`` (it names both)."""
    if kl_ctrl.type == "adaptive" and kl_ctrl.horizon <= KL_ERROR_CLIP * trajectories:
        raise ValueError(f"kl_ctrl.horizon ({kl_ctrl.horizon}) must be > 0.2 * the trajectories per step "
                         f"({trajectories}): beta *= 1 + e * {trajectories} / horizon with e down to -0.2 would not "
                         "stay positive; verl's default horizon is 10000")


class KLController:
    """The current KL coefficient ``value`` (float) and its update; ``state_dict`` / ``load_state_dict`` carry it
    through checkpoints (plain JSON numbers, exact: Python writes a float's shortest round-tripping repr).

    Args:
        kl_coef: initial coefficient (``AlgorithmConfig.kl_coef``), >= 0.
        config: the controller (``AlgorithmConfig.kl_ctrl``).
    """

    def __init__(self, kl_coef: float, config: KLControlConfig = KLControlConfig()) -> None:
        check_kl_ctrl(config, kl_coef)
        self.config = config
        self.value = float(kl_coef)
        """The coefficient ``beta`` the next step uses."""
        self.updates = 0
        """Updates applied so far (adaptive only; informational)."""

    def update(self, observed_kl: float, n_steps: int) -> float:
        """After a step: ``beta *= 1 + clip(observed_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``
        (Ziegler et al. 2019, §2.2) when adaptive; nothing when fixed, or when ``observed_kl`` is not finite
        (logged as ``kl_ctrl_skipped``: a NaN would otherwise poison ``beta`` for good). Returns the new value.

        Args:
            observed_kl: the step's KL to the reference (nats per token, ``kl_to_ref``).
            n_steps: trajectories (rows) in the step's batch, >= 1.

        Raises:
            ValueError: ``n_steps < 1``, or the multiplier would be <= 0 (``horizon`` too short for the batch).
        """
        if self.config.type == "fixed":
            return self.value
        if n_steps < 1:
            raise ValueError(f"n_steps ({n_steps}) must be a positive number of trajectories")
        if not math.isfinite(observed_kl):
            log.warning("kl_ctrl_skipped", observed_kl=observed_kl, kl_coef=self.value)
            return self.value
        error = min(max(observed_kl / self.config.target_kl - 1.0, -KL_ERROR_CLIP), KL_ERROR_CLIP)
        mult = 1.0 + error * n_steps / self.config.horizon
        if mult <= 0:
            check_horizon(self.config, n_steps)  # raises, naming horizon and n_steps
        self.value *= mult
        self.updates += 1
        return self.value

    def state_dict(self) -> dict:
        """``{"type": str, "kl_coef": float, "updates": int}``: JSON-safe, exact."""
        return {"type": self.config.type, "kl_coef": self.value, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``'s output when both it and this controller are ``adaptive``. Otherwise the value
        stays ``kl_coef`` (logged as ``kl_ctrl_not_restored`` when the saved type differs): a fixed controller always
        uses the configured ``kl_coef``, an adaptive one resumed from a fixed run (or from a checkpoint written
        before the controller was saved: empty ``state``) starts from it.

        Raises:
            ValueError: an adaptive state whose ``kl_coef`` is not a finite number >= 0."""
        if self.config.type != "adaptive" or state.get("type") != "adaptive":
            if state and state.get("type") != self.config.type:
                log.info("kl_ctrl_not_restored", saved=state.get("type"), current=self.config.type, kl_coef=self.value)
            return
        value = state["kl_coef"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"kl_ctrl state kl_coef ({value!r}) must be a finite number >= 0")
        self.value, self.updates = float(value), int(state.get("updates", 0))
