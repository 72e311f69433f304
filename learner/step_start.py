"""What a learner step computes from the policy as it stands, before its first update: the critic's ``V_old``
and GAE, the KL in the reward, and (with more than one update per batch) the proximal logprobs the PPO clip is
anchored to. They are those of the deterministic network vLLM samples from, so they are computed with dropout
off (``eval_mode``).

Training forwards keep the model's own dropout (a config with ``attention_dropout > 0`` still regularises
the update and draws from the torch RNG). With one update per batch the proximal logprobs are the training
forward's own, detached (verl does the same on-policy): the anchor is the same parameters, ``pi / pi_prox`` is
exactly 1 and a separate dropout-off pass would only add the dropout noise to it (and cost a forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gyre.learner.algo.advantages import gae, group_advantages, kl_shaped_rewards, masked_group_advantages
from gyre.learner.batch import TrainBatch
from gyre.learner.algo.losses import kl_penalty
from gyre.learner.algo.objectives import AdvantageInputs, custom_advantages


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Switch ``module`` (and every submodule) to eval mode, so dropout is off, and restore the previous
    ``training`` flag of the module tree on exit (each submodule's own flag, even on an exception)."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in flags:
            m.training = training


@dataclass(frozen=True)
class StepTargets:
    """Advantages that need the model, from ``step_targets``. Tensors are float32 on CPU; the ``[B, L - 1]``
    ones are aligned with ``TrainBatch.response_mask`` and 0 off the mask."""

    advantages: torch.Tensor
    """``[B, L - 1]`` per-token GAE advantages (``learner.algo.advantages.gae``), or ``[B]`` outcome advantages of
    the rows' KL-shaped returns (``learner.algo.advantages.group_advantages``); replaces ``TrainBatch.advantages``."""

    returns: torch.Tensor | None
    """Value targets ``A + V_old`` (critic only)."""

    old_values: torch.Tensor | None
    """``V_old(s_t)``: the value head's predictions before this step's update (the clip anchor; critic only)."""

    kl_to_ref: float | None
    """Token-mean k3 estimate of ``KL(pi || pi_ref)`` at step start (``kl_placement: reward`` only)."""


@torch.no_grad()
def step_targets(learner, batch: TrainBatch) -> StepTargets | None:
    """One no-grad pass over the whole batch (on every rank) with dropout off, when the advantages need the
    model: the critic's ``V_old`` and GAE (``advantage: gae``), and per-token ``x = log pi - log pi_ref`` for
    the KL in the reward (``kl_placement: reward``, ``learner.algo.advantages.kl_shaped_rewards``), whose row sums
    the outcome estimators (or a custom one, ``learner.objectives``) regroup (``TrainBatch.group_rows``). The
    outcome reward is the batch's ``shaped_rewards`` (the soft overlong penalty included); a row
    ``overlong_filter`` masked keeps it as its return, without a KL term.

    Args:
        learner: a ``learner.engine.LearnerEngine`` (its ``engine``, ``algo``, ``critic``, ``ref_model``, ``kl_ctrl``,
            ``_micro_plan``, ``_pass`` and ``_ref_logprobs``).
        batch: the step's batch.

    Returns:
        The targets, or None when neither is configured (``TrainBatch.advantages`` stand).
    """
    algo = learner.algo
    kl_in_reward = learner.ref_model is not None and algo.kl_placement == "reward"
    if not (learner.critic or kl_in_reward):
        return None
    mask = batch.response_mask
    old_values, kl = torch.zeros(mask.shape), torch.zeros(mask.shape)
    with eval_mode(learner.engine):
        for rows in learner._micro_plan(batch)[0]:  # the whole batch on every rank
            out = learner._pass(batch, rows)
            cols = slice(0, out.mask.shape[1])
            if out.values is not None:
                old_values[rows, cols] = out.values.cpu()
            if kl_in_reward:
                kl[rows, cols] = (out.logprobs - learner._ref_logprobs(batch, rows)).cpu()
    old_values = old_values * mask
    rewards = kl_shaped_rewards(batch.shaped_rewards, kl, mask, learner.kl_ctrl.value if kl_in_reward else 0.0)
    returns, kl_to_ref = None, None
    if learner.critic:
        advantages, returns = gae(rewards, old_values, mask, algo.gamma, algo.lam)
    else:
        returns = rewards.sum(dim=1)
        if algo.overlong_filter:  # a masked truncated row keeps its reward in the baseline (no tokens: no KL)
            returns = torch.where(batch.truncated, batch.shaped_rewards, returns)
        if algo.custom_advantage:  # ``learner.objectives``: the KL-shaped returns
            advantages = custom_advantages(AdvantageInputs(returns, batch.group_rows, batch.baseline_rows, mask,
                                                           batch.behaviour_logprobs, batch.staleness, algo))
        elif bool(batch.baseline_rows.all()):
            advantages = group_advantages(algo.advantage, returns, batch.group_rows, algo.adv_eps, mask.sum(dim=1))
        else:  # failed scores: baselines of the scored rows only (``learner.batch.scored_rows``)
            advantages, _ = masked_group_advantages(algo.advantage, returns, batch.group_rows, algo.adv_eps,
                                                    batch.baseline_rows, mask.sum(dim=1))
    if kl_in_reward:
        kl_to_ref = float(kl_penalty(kl, torch.zeros_like(kl), mask, "k3").sum()) / max(float(mask.sum()), 1.0)
    return StepTargets(advantages, returns, old_values if learner.critic else None, kl_to_ref)


def mini_batch_rows(batch_size: int, mini_batches: int) -> list[range]:
    """The batch's rows split into ``mini_batches`` contiguous, equal mini-batches (one optimizer update each).

    Raises:
        ValueError: ``batch_size`` is not a positive multiple of ``mini_batches``.
    """
    if mini_batches < 1 or batch_size < mini_batches or batch_size % mini_batches:
        raise ValueError(f"a batch of {batch_size} rows cannot be split into {mini_batches} equal mini-batches: "
                         "make groups_per_step * group_size a multiple of learner.algorithm.mini_batches")
    size = batch_size // mini_batches
    return [range(i * size, (i + 1) * size) for i in range(mini_batches)]


@torch.no_grad()
def proximal_logprobs(learner, batch: TrainBatch, micro: list[torch.Tensor]) -> torch.Tensor:
    """The proximal logprobs ``log pi_prox`` every update of the batch is clipped against: the policy before
    the batch's first update, in a no-grad pass with dropout off, over the micro-batches this rank trains (the
    same rows and packing as its training forwards, so without dropout the first update's ratio is 1 up
    to the no-grad kernels' rounding).

    Args:
        learner: a ``learner.engine.LearnerEngine`` (``engine``, ``_pass``).
        batch: the step's batch.
        micro: ``[b]`` int64 row indices of the micro-batches to compute (this rank's, of every mini-batch).

    Returns:
        ``[B, L - 1]`` float32 on CPU, aligned with ``TrainBatch.response_mask``; 0 at rows outside ``micro``
        and off the response tokens.
    """
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
    with eval_mode(learner.engine):
        for rows in micro:
            logprobs = learner._pass(batch, rows).logprobs
            out[rows, : logprobs.shape[1]] = logprobs.cpu()
    return out
