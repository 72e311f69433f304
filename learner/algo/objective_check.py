"""The load-time check of custom objectives (``learner.objectives``): import each one and run it on a tiny
synthetic batch, on the CPU, without a model, before anything starts.

The batch: ``B = 4`` rows in 2 groups of 2 (rows ``[[0, 1], [2, 3]]``), ``T = 5`` positions, response masks of
4, 2, 3 and 1 tokens after a one- or two-token prompt, rewards ``[1, 0, 0.5, 0.25]``, behaviour logprobs in
``[-2, -0.5]``. A custom advantage must return a finite float32 ``[4]`` or ``[4, 5]`` tensor. A custom loss gets
the advantages the run's estimator gives on that batch (its ``[B]`` or ``[B, T]`` shape) and must return a
finite float32 0-dim tensor whose gradient reaches ``logprobs``, is finite, and is 0 off the response mask.
Called by ``learner.loop_config.LearnerLoopConfig`` (the recipe's ``learner`` section, validated on the driver and
again in every learner actor) and by ``learner.engine.LearnerEngine``.
"""

from __future__ import annotations

import torch

from gyre.learner.algo.advantages import gae, group_advantages, outcome_token_rewards
from gyre.learner.config import AlgorithmConfig
from gyre.learner.algo.losses import loss_normaliser, row_token_scale
from gyre.learner.algo.objectives import (AdvantageInputs, ObjectiveError, contract_error, custom_advantages,
                                 custom_policy_loss, load_objective)

GROUP_ROWS = [[0, 1], [2, 3]]
"""The synthetic batch's groups: ``B = 4`` rows, ``G = 2`` groups of ``n = 2``."""
SPANS = [(1, 5), (1, 3), (2, 5), (2, 3)]
"""Each row's response positions ``[start, stop)`` of ``T = 5``: a prompt before, padding after."""
REWARDS = [1.0, 0.0, 0.5, 0.25]
"""The synthetic rows' rewards."""


def synthetic_advantage_inputs(cfg: AlgorithmConfig) -> AdvantageInputs:
    """The synthetic batch as a custom estimator sees it (every row scored, staleness 0, 1, 2, 3)."""
    mask = torch.zeros(len(SPANS), 5, dtype=torch.bool)
    for row, (lo, hi) in enumerate(SPANS):
        mask[row, lo:hi] = True
    positions = torch.arange(5, dtype=torch.float32).expand(len(SPANS), 5)
    behaviour = torch.where(mask, -0.5 - 0.3 * positions, torch.zeros_like(positions))
    return AdvantageInputs(rewards=torch.tensor(REWARDS), group_rows=torch.tensor(GROUP_ROWS),
                           scored=torch.ones(len(SPANS), dtype=torch.bool), response_mask=mask,
                           behaviour_logprobs=behaviour, staleness=torch.arange(len(SPANS)), cfg=cfg)


def synthetic_advantages(cfg: AlgorithmConfig, inputs: AdvantageInputs) -> torch.Tensor:
    """The run's advantages on the synthetic batch: the custom estimator's (checked), ``gae``'s ``[B, T]`` with
    zero values, or a built-in outcome estimator's ``[B]``."""
    if cfg.custom_advantage:
        return custom_advantages(inputs)
    if cfg.advantage == "gae":
        token_rewards = outcome_token_rewards(inputs.rewards, inputs.response_mask)
        return gae(token_rewards, torch.zeros_like(token_rewards), inputs.response_mask, cfg.gamma, cfg.lam)[0]
    counts = inputs.response_mask.sum(dim=1)
    return group_advantages(cfg.advantage, inputs.rewards, inputs.group_rows, cfg.adv_eps, counts)


def _check_loss(cfg: AlgorithmConfig, inputs: AdvantageInputs, advantages: torch.Tensor) -> None:
    """Run the custom loss on the synthetic batch (one update per batch: proximal = logprobs) and check the
    gradient it sends to ``logprobs``."""
    mask = inputs.response_mask
    offset = torch.where(mask, 0.05 * torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1), torch.zeros(mask.shape))
    leaf = (inputs.behaviour_logprobs + offset).requires_grad_(True)
    logprobs = leaf * 1.0  # a non-leaf with grad, as the model's are
    loss, _ = custom_policy_loss(logprobs, logprobs.detach(), inputs.behaviour_logprobs, advantages, mask, cfg,
                                 loss_normaliser(cfg, mask), row_token_scale(cfg, mask))
    loss.backward()
    if leaf.grad is None:
        raise contract_error("loss", cfg.loss, "backward() sent no gradient to inputs.logprobs; expected a loss "
                                               "computed from inputs.logprobs")
    if not bool(torch.isfinite(leaf.grad).all()):
        raise contract_error("loss", cfg.loss, "the gradient w.r.t. inputs.logprobs has non-finite values; "
                                               "expected finite gradients")
    off = int((leaf.grad[~mask] != 0).sum())
    if off:
        raise contract_error("loss", cfg.loss, f"the gradient w.r.t. inputs.logprobs is non-zero at {off} "
                                               "position(s) off response_mask (prompt or padding); expected a loss "
                                               "of the masked tokens only (inputs.aggregate masks)")


def check_objectives(cfg: AlgorithmConfig) -> None:
    """Import and check the custom ``advantage`` and ``loss`` of ``cfg`` (nothing for built-ins).

    Raises:
        learner.objectives.ObjectiveError: a function that does not load, raises, or breaks the contract; the
            message names the recipe key, the path and the problem (tensor, expected vs got).
    """
    if not (cfg.custom_advantage or cfg.custom_loss):
        return
    if cfg.custom_advantage:  # import errors first, named without the synthetic batch
        load_objective("advantage", cfg.advantage)
    if cfg.custom_loss:
        load_objective("loss", cfg.loss)
    inputs = synthetic_advantage_inputs(cfg)
    try:
        with torch.no_grad():
            advantages = synthetic_advantages(cfg, inputs)
        if cfg.custom_loss:
            with torch.enable_grad():
                _check_loss(cfg, inputs, advantages)
    except ObjectiveError as exc:
        raise ObjectiveError(f"{exc}, on the synthetic batch of learner.objective_check (B=4 rows in 2 groups of 2, "
                             "T=5)") from exc.__cause__
