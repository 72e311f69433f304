"""Pure torch functions of the RL algorithm: token logprobs, GRPO advantages, decoupled PPO + TIS loss.

No state, no distributed code: everything here is testable on tiny tensors.

References:
    - GRPO: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
      Language Models" (group-normalised advantages, no value function).
    - Decoupled PPO: Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System
      for Language Reasoning" (clip against a *proximal* policy, correct behaviour → proximal by IS).
    - TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
      (truncated importance sampling weight ``min(pi_learner / pi_rollout, C)``).
    - Token-mean aggregation: Yu et al. 2025, "DAPO".
"""

from __future__ import annotations

import torch

from learner.config import AlgorithmConfig


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each next token under ``softmax(logits / temperature)``.

    Args:
        logits: ``[B, L, V]`` any float dtype; ``logits[:, j]`` predicts ``input_ids[:, j + 1]``.
        input_ids: ``[B, L]`` int64.
        temperature: divides the logits (match the rollout's sampling temperature).

    Returns:
        ``[B, L - 1]`` float32, natural log; entry ``j`` is ``log p(input_ids[:, j + 1] | input_ids[:, :j + 1])``.
        Computed in float32 as ``gather(logits) - logsumexp(logits)`` (no ``[B, L, V]`` log-softmax copy).
    """
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)} disagree on [B, L]")
    shifted = logits[:, :-1].float()
    if temperature != 1.0:
        shifted = shifted / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    picked = torch.gather(shifted, -1, targets).squeeze(-1)
    return picked - torch.logsumexp(shifted, dim=-1)


def grpo_advantages(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """Group-normalised advantages ``(r - mean_g) / (std_g + eps)`` (GRPO outcome supervision, Shao et al. 2024).

    ``std_g`` is the *population* std (divide by ``n``, ``unbiased=False``): it is defined for any
    group size including ``n = 1`` (the sample std is NaN there), and it makes the advantages of
    every non-constant group have exactly unit root-mean-square. A group whose rewards are all equal
    gets advantage 0 for every member (``0 / (0 + eps)``).

    Args:
        rewards: ``[G, n]`` float, one row per group.
        eps: ``> 0``, added to the std.

    Returns:
        ``[G, n]`` float32 advantages.

    Raises:
        ValueError: ``rewards`` is not 2-D or ``eps`` is not positive.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, n]; got shape {tuple(rewards.shape)}")
    if eps <= 0:
        raise ValueError(f"eps ({eps}) must be > 0")
    r = rewards.float()
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    return (r - mean) / (std + eps)


def policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
    normaliser: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO-clip loss with a truncated importance weight, token-mean aggregated.

    Per valid token (decoupled objective of AReaL, Fu et al. 2025, with TIS of Yao et al. 2025)::

        r = exp(logprobs - proximal)                                  # current / proximal
        w = min(exp(proximal - behaviour), C)        (detached)       # proximal / behaviour, truncated
        l = -w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
        loss = sum_valid(l) / normaliser                              # DAPO token-mean

    Args:
        logprobs: ``[B, T]`` float32, current policy, with grad.
        proximal_logprobs: ``[B, T]`` float32, the learner's logprobs at the start of the step
            (detached here; with one optimizer step per batch this is ``logprobs.detach()``).
        behaviour_logprobs: ``[B, T]`` float32, the rollout's logprobs (any value at masked positions).
        advantages: ``[B]`` float32, one per sequence, broadcast over its tokens.
        mask: ``[B, T]`` bool, True at response tokens that count.
        cfg: clip ranges and TIS cap ``C``.
        normaliser: number of valid tokens the loss is averaged over; pass the *full batch's* count
            when this call sees one micro-batch so that the summed micro-batch gradients equal the
            full-batch gradient. Defaults to ``mask.sum()`` (at least 1).

    Returns:
        ``(loss, metrics)``: scalar loss tensor; metrics (floats, over this call's valid tokens, 0 if
        none): ``is_ratio_mean`` / ``is_ratio_max`` of ``exp(proximal - behaviour)`` before truncation,
        ``tis_clip_frac`` (fraction with that ratio above ``C``), ``ppo_clip_frac`` (fraction where the
        clipped branch is active, i.e. zero gradient), ``approx_kl`` = mean of Schulman's k3 estimator
        of KL(behaviour || current) with ``rho = exp(proximal - behaviour)``: ``rho - 1 - log rho``
        (samples come from behaviour, so this is unbiased and ``>= 0``), and ``valid_tokens``.

    Raises:
        ValueError: shapes disagree or ``normaliser`` is not positive.
    """
    _check_shapes(logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask)
    if normaliser is None:
        normaliser = max(float(mask.sum()), 1.0)
    if normaliser <= 0:
        raise ValueError(f"normaliser ({normaliser}) must be > 0")
    proximal = proximal_logprobs.detach().float()
    log_ratio = torch.where(mask, logprobs.float() - proximal, torch.zeros_like(proximal))
    log_is = torch.where(mask, proximal - behaviour_logprobs.float(), torch.zeros_like(proximal))
    ratio = torch.exp(log_ratio)
    is_ratio = torch.exp(log_is)
    tis_weight = torch.clamp(is_ratio, max=cfg.tis_cap)
    adv = advantages.float().unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped) * tis_weight
    loss = torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / normaliser
    with torch.no_grad():
        metrics = _metrics(is_ratio, log_is, unclipped, clipped, mask, cfg.tis_cap)
    return loss, metrics


def _check_shapes(logprobs, proximal, behaviour, advantages, mask) -> None:
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T]; got {tuple(shape)}")
    for name, t in (("proximal_logprobs", proximal), ("behaviour_logprobs", behaviour), ("mask", mask)):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool; got {mask.dtype}")
    if advantages.shape != shape[:1]:
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected ({shape[0]},)")


def _metrics(is_ratio, log_is, unclipped, clipped, mask, tis_cap: float) -> dict[str, float]:
    n = int(mask.sum())
    if n == 0:
        keys = ("is_ratio_mean", "is_ratio_max", "tis_clip_frac", "ppo_clip_frac", "approx_kl")
        return {**{k: 0.0 for k in keys}, "valid_tokens": 0.0}
    valid_is = is_ratio[mask]
    k3 = valid_is - 1.0 - log_is[mask]
    return {
        "is_ratio_mean": float(valid_is.mean()),
        "is_ratio_max": float(valid_is.max()),
        "tis_clip_frac": float((valid_is > tis_cap).float().mean()),
        "ppo_clip_frac": float((clipped < unclipped)[mask].float().mean()),
        "approx_kl": float(k3.mean()),
        "valid_tokens": float(n),
    }
