"""Loss terms of the learner step: PPO-clip policy loss with off-policy corrections, KL to a
reference model, entropy, and the critic's clipped value loss. Pure torch, no state.

Every term is a *sum* over valid tokens (each row's tokens scaled by ``row_token_scale`` for
``seq-mean-token-mean``) divided by a caller-given ``normaliser`` (``loss_normaliser``), so per-micro-batch
losses add up to the whole (mini-)batch's loss and gradient.

References:
    - Decoupled PPO: Fu et al. 2025, "AReaL" (clip against a *proximal* policy, correct behaviour ->
      proximal by importance sampling).
    - TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
      (truncated importance weight ``min(pi_learner / pi_rollout, C)``, token or sequence level).
    - MIS / "icepop": masked importance sampling of the 2025 off-policy RL literature (tokens or
      trajectories whose ratio leaves a band are dropped from the gradient, not clipped).
    - KL estimators k1/k2/k3: Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html;
      what their gradients train as losses: Tang & Munos 2025, "On a few pitfalls in KL divergence
      gradient estimation for RL".
    - Value clipping: Schulman et al. 2017 "PPO" / OpenAI baselines ``ppo2``.
    - Aggregations (verl's ``loss_agg_mode`` names): token-mean, Yu et al. 2025, "DAPO"; seq-mean-token-mean,
      Shao et al. 2024, "DeepSeekMath" (GRPO); constant token-sum, Liu et al. 2025, "Dr.GRPO".
    - Dual-clip PPO: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning".
"""

from __future__ import annotations

import math

import torch

from gyre.learner.config import AlgorithmConfig


def loss_normaliser(cfg: AlgorithmConfig, response_mask: torch.Tensor) -> float:
    """What the (mini-)batch's summed token losses are divided by, for ``cfg.agg_mode`` (``loss_agg_mode``).

    Args:
        cfg: ``loss_agg_mode`` / ``advantage`` / ``max_response_tokens``.
        response_mask: ``[B, T]`` bool of the *whole* (mini-)batch, not of one micro-batch.

    Returns:
        ``token-mean``: ``N``, its valid tokens (at least 1). ``seq-mean-token-mean`` and
        ``seq-mean-token-sum``: ``B`` (each row's tokens are first scaled by ``row_token_scale``).
        ``seq-mean-token-sum-norm`` (Dr.GRPO): ``B * cfg.max_response_tokens``.
    """
    mode, rows = cfg.agg_mode, response_mask.shape[0]
    if mode == "token-mean":
        return float(max(int(response_mask.sum()), 1))
    if mode == "seq-mean-token-sum-norm":
        return float(max(cfg.max_response_tokens * rows, 1))
    return float(max(rows, 1))


def row_token_scale(cfg: AlgorithmConfig, response_mask: torch.Tensor) -> torch.Tensor | None:
    """Per-row factor on every token's loss before the sum, or None when it is 1 for every row.

    ``seq-mean-token-mean`` (GRPO's ``1/|o_i|``, Shao et al. 2024): ``1 / |o_i|`` for a row of ``|o_i| >= 1``
    valid tokens (1 for a row of none, which adds nothing anyway); with ``loss_normaliser``'s ``B`` the loss is
    the mean over rows of each row's token mean. Every other mode: None.

    Args:
        cfg: ``loss_agg_mode`` / ``advantage``.
        response_mask: ``[B, T]`` bool.

    Returns:
        ``[B]`` float32 or None.
    """
    if cfg.agg_mode != "seq-mean-token-mean":
        return None
    return 1.0 / response_mask.sum(dim=1).clamp(min=1).float()


def scaled_token_sum(x: torch.Tensor, mask: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_{i,t in mask} x_it * row_scale_i`` (0 off ``mask``; ``row_scale`` None: 1).

    Args:
        x: ``[B, T]`` float per-token values.
        mask: ``[B, T]`` bool.
        row_scale: ``[B]`` float (``row_token_scale``) or None.

    Returns:
        Scalar tensor (differentiable in ``x``).
    """
    if row_scale is not None:
        x = x * row_scale.to(x.device).unsqueeze(1)
    return _masked_sum(x, mask)


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum()


def importance_weights(
    log_rho: torch.Tensor, mask: torch.Tensor, cfg: AlgorithmConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``cfg.is_weight`` correction from ``log_rho = log pi_proximal - log pi_behaviour``.

    Args:
        log_rho: ``[B, T]`` float32, detached, 0 where ``mask`` is False.
        mask: ``[B, T]`` bool, valid tokens.
        cfg: ``is_weight``, ``tis_cap``, ``mis_low``, ``mis_high``.

    Returns:
        ``(weight, keep, truncated)``, each ``[B, T]``: the float32 weight multiplied into each token's
        loss; bool ``keep`` (False where MIS drops the token; all True otherwise); bool ``truncated``
        (True where TIS capped the weight). Sequence-level modes use ``sum_t log_rho_t`` of the row
        (the log of the product of token ratios) for every token of that row.
    """
    ones = torch.ones_like(log_rho)
    every = torch.ones_like(mask)
    none = torch.zeros_like(mask)
    mode = cfg.is_weight
    if mode == "none":
        return ones, every, none
    log_w = log_rho
    if mode.endswith("_seq"):
        log_w = torch.where(mask, log_rho, torch.zeros_like(log_rho)).sum(dim=1, keepdim=True).expand_as(log_rho)
    if mode.startswith("tis"):
        rho = torch.exp(log_w)  # a sequence's product may overflow to inf: truncated to the cap below
        return torch.clamp(rho, max=cfg.tis_cap), every, (rho > cfg.tis_cap) & mask
    low = math.log(cfg.mis_low) if cfg.mis_low > 0 else -math.inf
    high = math.log(cfg.mis_high)
    keep = (log_w >= low) & (log_w <= high)
    return ones, keep, none


def policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
    normaliser: float | None = None,
    row_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip policy loss with the configured off-policy correction, summed over valid tokens.

    Per valid token, with ``anchor`` = proximal (``cfg.policy_ratio == "proximal"``, decoupled PPO) or
    behaviour (``"behaviour"``, standard PPO against the rollout policy)::

        r    = exp(logprobs - anchor)                              # current / anchor
        rho  = exp(proximal - behaviour)          (detached)       # proximal / behaviour
        w, keep = importance_weights(log rho)                      # TIS / MIS / none
        s    = min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
        s    = max(s, c * A)   where A < 0, with dual_clip_c = c  (dual-clip, Ye et al. 2020; off: None)
        l    = -w * s                                               (0 where not keep)
        loss = sum_valid(l * row_scale) / normaliser

    Its gradient, ``-w * A * grad r`` where the unclipped branch is active and 0 where a clip is, estimates
    the policy gradient of the anchor's surrogate ``E[w r A]`` restricted to the trust region (PPO, Schulman
    et al. 2017); at ``r == 1`` (one update per batch, proximal anchor) it is ``-w * A * grad log pi``: the
    importance-weighted REINFORCE gradient, and the clip never acts (``AlgorithmConfig.mini_batches``).

    With the defaults (proximal anchor, ``tis_token``) this is AReaL's decoupled objective with
    Yao et al.'s token TIS. MIS-dropped tokens still count in ``normaliser`` (they are masked, not
    removed from the batch), so accumulation over micro-batches stays exact.

    Args:
        logprobs: ``[B, T]`` float32, current policy, with grad.
        proximal_logprobs: ``[B, T]`` float32, the learner's logprobs before the batch's first update
            (detached here; with one update per batch this is ``logprobs.detach()``).
        behaviour_logprobs: ``[B, T]`` float32, the rollout's logprobs (any value at masked positions).
        advantages: ``[B]`` (one per trajectory, broadcast over its tokens) or ``[B, T]`` (per token,
            GAE) float32.
        mask: ``[B, T]`` bool, True at response tokens that count.
        cfg: ``policy_ratio``, ``is_weight`` and its caps/band, clip ranges.
        normaliser: what the token sum is divided by; pass the *full batch's* value
            (``loss_normaliser``) when this call sees one micro-batch. Defaults to ``mask.sum()`` (>= 1).
        row_scale: ``[B]`` float per-row factor (``row_token_scale``), or None for 1.

    Returns:
        ``(loss, metrics)``: scalar loss tensor; metrics (floats over this call's valid tokens, 0 if
        none): ``is_ratio_mean`` / ``is_ratio_max`` of ``rho`` before any truncation,
        ``tis_clip_frac`` (fraction of tokens whose weight TIS capped), ``mis_masked_frac`` (fraction
        MIS dropped), ``ppo_clip_frac`` (fraction where the clipped branch is active, i.e. zero
        gradient), ``dual_clip_frac`` (fraction where the dual clip bounds the loss; 0 when off),
        ``approx_kl`` = mean of Schulman's k3 estimator of KL(behaviour || current) with
        ``rho``: ``rho - 1 - log rho`` (``>= 0``), and ``valid_tokens``.

    Raises:
        ValueError: shapes disagree or ``normaliser`` is not positive.
    """
    _check_shapes(logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask)
    if normaliser is None:
        normaliser = max(float(mask.sum()), 1.0)
    if normaliser <= 0:
        raise ValueError(f"normaliser ({normaliser}) must be > 0")
    zeros = torch.zeros_like(logprobs, dtype=torch.float32)
    proximal = proximal_logprobs.detach().float()
    behaviour = behaviour_logprobs.detach().float()
    anchor = proximal if cfg.policy_ratio == "proximal" else behaviour
    ratio = torch.exp(torch.where(mask, logprobs.float() - anchor, zeros))
    log_rho = torch.where(mask, proximal - behaviour, zeros)
    weight, keep, truncated = importance_weights(log_rho, mask, cfg)
    adv = advantages.float() if advantages.dim() == 2 else advantages.float().unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    dual = torch.zeros_like(mask)
    if cfg.dual_clip_c is not None:
        bound = cfg.dual_clip_c * adv
        dual = (adv < 0) & (surrogate < bound) & mask
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, bound), surrogate)
    per_token = -surrogate * weight
    loss = scaled_token_sum(per_token, mask & keep, row_scale) / normaliser
    with torch.no_grad():
        metrics = _metrics(log_rho, clipped < unclipped, truncated, ~keep, mask)
        metrics["dual_clip_frac"] = float(dual[mask].float().mean()) if metrics["valid_tokens"] else 0.0
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
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected ({shape[0]},) or {tuple(shape)}")


def _metrics(log_rho, ppo_clipped, truncated, dropped, mask) -> dict[str, float]:
    n = int(mask.sum())
    keys = ("is_ratio_mean", "is_ratio_max", "tis_clip_frac", "mis_masked_frac", "ppo_clip_frac", "approx_kl")
    if n == 0:
        return {**{k: 0.0 for k in keys}, "valid_tokens": 0.0}
    rho = torch.exp(log_rho[mask])
    k3 = rho - 1.0 - log_rho[mask]
    return {
        "is_ratio_mean": float(rho.mean()),
        "is_ratio_max": float(rho.max()),
        "tis_clip_frac": float(truncated[mask].float().mean()),
        "mis_masked_frac": float(dropped[mask].float().mean()),
        "ppo_clip_frac": float(ppo_clipped[mask].float().mean()),
        "approx_kl": float(k3.mean()),
        "valid_tokens": float(n),
    }


@torch.no_grad()
def ratio_metrics(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor
                  ) -> dict[str, float]:
    """The importance-ratio diagnostics of ``policy_loss`` that do not depend on the loss (reported beside a
    custom loss, ``learner.objectives``): ``is_ratio_mean``, ``is_ratio_max`` and ``approx_kl`` (k3) of
    ``rho = exp(proximal - behaviour)`` over the ``[B, T]`` bool ``mask``, and ``valid_tokens``."""
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    log_rho = torch.where(mask, proximal_logprobs.float() - behaviour_logprobs.float(), zeros)
    none = torch.zeros_like(mask)
    full = _metrics(log_rho, none, none, none, mask)
    return {k: full[k] for k in ("is_ratio_mean", "is_ratio_max", "approx_kl", "valid_tokens")}


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token KL term on sampled tokens, ``x = logprobs - ref_logprobs`` (the reference detached):
    ``k1 = x``, ``k2 = x^2 / 2``, ``k3 = exp(-x) - 1 + x`` (Schulman, http://joschu.net/blog/kl-approx.html).

    *Values*, over tokens ``a ~ pi``: ``E[k1] = E[k3] = KL(pi || pi_ref)`` (``k3 >= 0``, lower variance);
    ``E[k2] ~ KL(pi || pi_ref)`` only while ``pi`` stays close to ``pi_ref``.

    *Gradients* when summed into a loss (what training follows; Tang & Munos 2025), expectation over
    ``a ~ pi`` with the sampling distribution held fixed, per position (``config.KL_LOSS_GRADIENT``):

    - ``k1``: ``E[grad log pi] = 0``: no pull toward the reference, only noise (``AlgorithmConfig`` refuses
      it as a loss; as a reward ``-beta * x`` it is the PPO-RLHF penalty).
    - ``k2``: ``E[x grad log pi] = grad KL(pi || pi_ref)``.
    - ``k3``: ``E[(1 - pi_ref / pi) grad log pi] = -sum_a pi_ref(a) grad log pi(a) = grad KL(pi_ref || pi)``:
      the reversed KL, although its value estimates ``KL(pi || pi_ref)``.

    Args:
        logprobs: ``[B, T]`` float32, current policy, with grad.
        ref_logprobs: ``[B, T]`` float32, frozen reference model.
        mask: ``[B, T]`` bool; ``x`` is set to 0 elsewhere *before* the estimator, so prompt and
            padding positions can neither overflow ``exp(-x)`` nor leak NaN into the gradient.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        ``[B, T]`` float32 per-token values, 0 where ``mask`` is False.

    Raises:
        ValueError: shapes disagree or unknown ``estimator``.
    """
    for name, t in (("ref_logprobs", ref_logprobs), ("mask", mask)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(logprobs.shape)}")
    x = logprobs.float() - ref_logprobs.detach().float()
    x = torch.where(mask, x, torch.zeros_like(x))
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return torch.exp(-x) - 1.0 + x
    raise ValueError(f"kl estimator {estimator!r}; expected 'k1', 'k2' or 'k3'")


def token_entropy(logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (nats) of ``softmax(logits / temperature)`` at each scored position, only where ``mask``.

    Per position the exact entropy of the whole next-token distribution (a sum over the vocabulary, given
    the sampled prefix), not an estimate from the sampled token. No averaging here: the learner sums it over
    the valid response tokens and divides by the policy loss's normaliser (``AlgorithmConfig.entropy_coef``).

    Args:
        logits: ``[B, L, V]``; position ``j`` predicts token ``j + 1`` (as in ``token_logprobs``).
        mask: ``[B, L - 1]`` bool; entropy is computed (in float32, ``[N, V]`` for N valid tokens)
            only there, to spare the prompt and padding positions.
        temperature: divides the logits.

    Returns:
        ``[B, L - 1]`` float32, ``H = logsumexp(z) - sum(softmax(z) * z)``, 0 where ``mask`` is False;
        differentiable.

    Raises:
        ValueError: ``mask`` is not ``[B, L - 1]``.
    """
    if mask.shape != (logits.shape[0], logits.shape[1] - 1):
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {(logits.shape[0], logits.shape[1] - 1)}")
    z = logits[:, :-1][mask].float() / temperature  # [N, V]
    h = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)
    return out.masked_scatter(mask, h)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    normaliser: float,
    row_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped value loss (Schulman et al. 2017; OpenAI baselines ``ppo2``)::

        V_clip = V_old + clamp(V - V_old, -clip, clip)
        l      = 0.5 * max((V - R)^2, (V_clip - R)^2)
        loss   = sum_valid(l * row_scale) / normaliser

    Its gradient moves ``V`` toward ``R`` (the regression gradient ``(V - R) grad V``) until ``V`` leaves the
    ``clip`` band around ``V_old`` on the far side of ``R``, where it is 0.

    Args:
        values: ``[B, T]`` float, the critic now, with grad.
        old_values: ``[B, T]`` float, the critic at the start of the step (detached).
        returns: ``[B, T]`` float, GAE value targets ``R`` (detached).
        mask: ``[B, T]`` bool.
        clip: ``> 0``, how far ``V`` may move from ``V_old`` before the clipped branch dominates.
        normaliser: ``> 0``.
        row_scale: ``[B]`` float per-row factor (``row_token_scale``), or None for 1.

    Returns:
        ``(loss, metrics)``: ``value_loss`` (the token mean of ``l`` over the valid tokens, whatever the
        aggregation: what is logged), ``value_clip_frac`` (fraction of valid tokens where the clipped branch is
        the larger one) and ``valid_tokens``.

    Raises:
        ValueError: shapes disagree, ``clip`` or ``normaliser`` not positive.
    """
    for name, t in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        if t.shape != values.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(values.shape)}")
    if clip <= 0 or normaliser <= 0:
        raise ValueError(f"clip ({clip}) and normaliser ({normaliser}) must be > 0")
    v = values.float()
    old = old_values.detach().float()
    ret = returns.detach().float()
    v_clip = old + torch.clamp(v - old, -clip, clip)
    unclipped, clipped = (v - ret) ** 2, (v_clip - ret) ** 2
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    loss = scaled_token_sum(per_token, mask, row_scale) / normaliser
    n = int(mask.sum())
    frac = float((clipped > unclipped)[mask].float().mean()) if n else 0.0
    mean = float(per_token.detach()[mask].mean()) if n else 0.0
    return loss, {"value_loss": mean, "value_clip_frac": frac, "valid_tokens": float(n)}
