"""A custom policy loss: a policy gradient with a truncated, stop-gradient importance weight.

Recipe: ``learner.algorithm.loss: "examples/objectives/losses.py:clipped_is_pg"`` (a file path, relative to where
gyre runs) or ``"examples.objectives.losses:clipped_is_pg"`` (a module, importable from there).
"""

from __future__ import annotations

import torch

from gyre.learner.algo.objectives import LossInputs


def clipped_is_pg(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance-sampled policy gradient against the rollout's behaviour policy, per token::

        w_t = sg(min(pi_theta(a_t) / pi_behaviour(a_t), C))        C = cfg.tis_cap
        l_t = -w_t * A_t * log pi_theta(a_t)
        loss = inputs.aggregate(l)                                  (loss_agg_mode)

    Its gradient, ``-w_t A_t grad log pi_theta(a_t)``, estimates the policy gradient ``grad E_{pi_theta}[A]``
    from tokens sampled by ``pi_behaviour``: exactly (importance sampling) where ``w_t`` is not truncated, biased
    toward zero where the ratio exceeds ``C``, which bounds the variance a stale or mismatched token can add
    (truncated IS, Yao et al. 2025; the weight is clipped but every token keeps a gradient, as in CISPO, MiniMax
    2025, unlike PPO's clip, which zeroes it). ``ppo_clip`` with ``policy_ratio: behaviour`` would instead drop the
    gradient of tokens whose ratio leaves the clip range.

    Args:
        inputs: ``logprobs`` (with grad), ``behaviour_logprobs``, ``advantages`` (``[B]`` or ``[B, T]``),
            ``response_mask``, ``cfg.tis_cap`` (see ``learner.objectives.LossInputs``).

    Returns:
        ``(loss, metrics)``: the 0-dim loss (a surrogate: its gradient is the estimate, its value is not an
        objective); ``ratio_mean``, the mean ratio ``pi_theta / pi_behaviour`` before truncation, and
        ``ratio_clip_frac``, the fraction of tokens whose ratio exceeds ``C``, over this micro-batch's valid tokens
        (logged as ``custom_loss/ratio_mean`` and ``custom_loss/ratio_clip_frac``).
    """
    mask = inputs.response_mask
    zeros = torch.zeros_like(inputs.logprobs)
    log_ratio = torch.where(mask, inputs.logprobs.detach() - inputs.behaviour_logprobs, zeros)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=inputs.cfg.tis_cap)
    adv = inputs.advantages if inputs.advantages.dim() == 2 else inputs.advantages.unsqueeze(1)
    loss = inputs.aggregate(-weight * adv * inputs.logprobs)
    n = int(mask.sum())
    metrics = {"ratio_mean": float(ratio[mask].mean()) if n else 0.0,
               "ratio_clip_frac": float((ratio[mask] > inputs.cfg.tis_cap).float().mean()) if n else 0.0}
    return loss, metrics
