"""Advantage estimators: outcome-reward baselines over groups, and GAE over a value model.

Pure torch, no state. The outcome estimators map ``[G, n]`` group rewards (one scalar reward per
trajectory, ``n`` samples of the same prompt per row) to ``[G, n]`` advantages that are broadcast
over each trajectory's response tokens; ``gae`` maps per-token rewards and values to per-token
advantages and returns.

References:
    - GRPO: Shao et al. 2024, "DeepSeekMath" (group mean/std normalisation).
    - Dr.GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
      (no std division; the matching constant loss normaliser is ``learner.algo.losses.loss_normaliser``).
    - RLOO: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
      Learning from Human Feedback in LLMs" (leave-one-out baseline).
    - REINFORCE++-baseline: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning
      Large Language Models" (group-mean baseline, then normalised over the whole batch).
    - Soft overlong punishment: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
      Scale" (eq. 13).
    - KL in the reward: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences";
      Ouyang et al. 2022, "Training language models to follow instructions with human feedback".
    - GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
      Estimation".
"""

from __future__ import annotations

import torch

OUTCOME_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp")


def _check_groups(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, n]; got shape {tuple(rewards.shape)}")
    return rewards.float()


def _check_eps(eps: float) -> None:
    if eps <= 0:
        raise ValueError(f"eps ({eps}) must be > 0")


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
    r = _check_groups(rewards)
    _check_eps(eps)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    return (r - mean) / (std + eps)


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO advantages ``r - mean_g`` (Liu et al. 2025): GRPO without the std division, which
    up-weights near-constant (too easy / too hard) groups.

    Args:
        rewards: ``[G, n]`` float.

    Returns:
        ``[G, n]`` float32; 0 for a group of equal rewards.

    Raises:
        ValueError: ``rewards`` is not 2-D.
    """
    r = _check_groups(rewards)
    return r - r.mean(dim=1, keepdim=True)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out advantages ``r_i - mean_{j != i} r_j`` (Ahmadian et al. 2024).

    Equal to ``n / (n - 1) * (r_i - mean_g)``: the baseline of each sample is the mean reward of the
    *other* samples of its group, so it is independent of ``r_i`` and the estimator is unbiased.

    Args:
        rewards: ``[G, n]`` float with ``n >= 2``.

    Returns:
        ``[G, n]`` float32.

    Raises:
        ValueError: ``rewards`` is not 2-D, or ``n < 2`` (no other sample to form a baseline).
    """
    r = _check_groups(rewards)
    n = r.shape[1]
    if n < 2:
        raise ValueError(f"RLOO needs groups of >= 2 samples (a leave-one-out baseline); got group size {n}")
    others_mean = (r.sum(dim=1, keepdim=True) - r) / (n - 1)
    return r - others_mean


def reinforce_pp_advantages(rewards: torch.Tensor, eps: float, token_counts: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++-baseline advantages (Hu 2025): subtract the group mean, then whiten the result over the
    batch's response *tokens*, as OpenRLHF's ``reinforce_baseline`` does (its advantages are per token, each
    row's value repeated on its tokens): with ``a = r - mean_g`` and ``n_i`` the response tokens of row ``i``,
    ``mu = sum_i n_i a_i / sum_i n_i``, ``var = sum_i n_i (a_i - mu)^2 / sum_i n_i``,
    ``A = (a - mu) / (sqrt(var) + eps)``. A long response's advantage weighs more in the statistics, as its
    tokens do in a ``token-mean`` loss. Without ``token_counts`` every row counts once (population std over
    all ``G * n`` entries).

    Args:
        rewards: ``[G, n]`` float.
        eps: ``> 0``, added to the batch std (OpenRLHF clamps the variance at 1e-8 instead).
        token_counts: ``[G, n]`` int or float, each row's response tokens (``>= 0``), or None.

    Returns:
        ``[G, n]`` float32; all 0 when every group has equal rewards.

    Raises:
        ValueError: ``rewards`` is not 2-D, ``eps`` is not positive, or ``token_counts`` has another shape or
            a negative entry.
    """
    _check_eps(eps)
    centred = dr_grpo_advantages(rewards)
    if token_counts is None:
        return (centred - centred.mean()) / (centred.std(unbiased=False) + eps)
    if token_counts.shape != centred.shape or bool((token_counts < 0).any()):
        raise ValueError(f"token_counts must be a [G, n] = {tuple(centred.shape)} count >= 0; got "
                         f"{tuple(token_counts.shape)}")
    return _token_whiten(centred, token_counts, eps)


def _token_whiten(centred: torch.Tensor, token_counts: torch.Tensor, eps: float) -> torch.Tensor:
    """``(a - mu) / (sigma + eps)`` with ``mu``, ``sigma`` weighted by ``token_counts`` (all-zero counts: 1 each)."""
    w = token_counts.float()
    w = w if float(w.sum()) > 0 else torch.ones_like(w)
    mean = (w * centred).sum() / w.sum()
    std = ((w * (centred - mean) ** 2).sum() / w.sum()).sqrt()
    return (centred - mean) / (std + eps)


def outcome_advantages(
    estimator: str, rewards: torch.Tensor, eps: float, token_counts: torch.Tensor | None = None
) -> torch.Tensor:
    """``[G, n]`` advantages of the named outcome estimator (``grpo``, ``dr_grpo``, ``rloo``,
    ``reinforce_pp``); ``eps`` is used by ``grpo`` and ``reinforce_pp``, ``token_counts`` (``[G, n]``, each
    row's response tokens) by ``reinforce_pp``'s token-level whitening.

    Raises:
        ValueError: unknown ``estimator`` (``gae`` is not an outcome estimator: it needs values); groups of
            ``n < 2`` (every baseline is the group's own mean or its other samples' mean: a group of one
            would train on advantage 0, or none for RLOO; the recipe refuses ``rollout.group_size < 2``
            for these); or the estimator's own errors.
    """
    if estimator in OUTCOME_ESTIMATORS and rewards.dim() == 2 and rewards.shape[1] < 2:
        raise ValueError(f"advantage estimator {estimator!r} needs groups of >= 2 samples (a group baseline); "
                         f"got group size {rewards.shape[1]}")
    if estimator == "grpo":
        return grpo_advantages(rewards, eps)
    if estimator == "dr_grpo":
        return dr_grpo_advantages(rewards)
    if estimator == "rloo":
        return rloo_advantages(rewards)
    if estimator == "reinforce_pp":
        return reinforce_pp_advantages(rewards, eps, token_counts)
    raise ValueError(
        f"advantage estimator {estimator!r} is not an outcome estimator; expected one of {OUTCOME_ESTIMATORS}"
    )


def group_advantages(
    estimator: str, returns: torch.Tensor, group_rows: torch.Tensor, eps: float,
    token_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``outcome_advantages`` of a batch whose rows are grouped by index rather than laid out ``[G, n]``.

    Args:
        estimator: an outcome estimator (``OUTCOME_ESTIMATORS``).
        returns: ``[B]`` float, one scalar return per row (the verifier reward, or with the KL in the
            reward ``r - beta * sum_t x_t``).
        group_rows: ``[G, n]`` int64, the row indices of each group (every row exactly once).
        eps: as in ``outcome_advantages``.
        token_counts: ``[B]`` each row's response tokens (``reinforce_pp``'s token whitening), or None.

    Returns:
        ``[B]`` float32, each row's advantage within its group.

    Raises:
        ValueError: ``group_rows`` is not ``[G, n]`` over ``B`` rows, or ``outcome_advantages``' errors.
    """
    if group_rows.dim() != 2 or group_rows.numel() != returns.numel():
        raise ValueError(f"group_rows {tuple(group_rows.shape)} must be [G, n] with G * n = {returns.numel()} rows")
    counts = None if token_counts is None else token_counts[group_rows]
    grouped = outcome_advantages(estimator, returns.float()[group_rows], eps, counts)
    out = torch.zeros(returns.shape, dtype=torch.float32)
    out[group_rows.flatten()] = grouped.flatten()
    return out


def masked_group_advantages(
    estimator: str, returns: torch.Tensor, group_rows: torch.Tensor, eps: float, valid: torch.Tensor,
    token_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``group_advantages`` over each group's ``valid`` rows only: a row whose score failed (``reward_error``)
    is neither trained nor part of its group's baseline, which is then formed by the other samples.

    A group left with fewer than 2 valid rows has no baseline: none of its rows trains. ``reinforce_pp``
    centres each group over its valid rows, then whitens over the trained rows' tokens.

    Args:
        estimator: an outcome estimator (``OUTCOME_ESTIMATORS``).
        returns: ``[B]`` float, one scalar return per row.
        group_rows: ``[G, n]`` int64, the row indices of each group.
        eps: as in ``outcome_advantages``.
        valid: ``[B]`` bool, the rows that count.
        token_counts: ``[B]`` each row's response tokens (``reinforce_pp``), or None.

    Returns:
        ``(advantages [B] float32, trained [B] bool)``: 0 and False outside the trained rows.

    Raises:
        ValueError: ``valid`` is not ``[B]`` bool, or ``group_advantages``' errors.
    """
    if valid.shape != returns.shape or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a [B] = {tuple(returns.shape)} bool tensor; got {tuple(valid.shape)} "
                         f"{valid.dtype}")
    if estimator not in OUTCOME_ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r} is not an outcome estimator; expected one of "
                         f"{OUTCOME_ESTIMATORS}")
    adv = torch.zeros(returns.shape, dtype=torch.float32)
    trained = torch.zeros(returns.shape, dtype=torch.bool)
    for rows in group_rows:
        rows = rows[valid[rows]]
        if rows.numel() < 2:
            continue
        r = returns.float()[rows].unsqueeze(0)  # [1, k]
        part = dr_grpo_advantages(r) if estimator == "reinforce_pp" else outcome_advantages(estimator, r, eps)
        adv[rows], trained[rows] = part.squeeze(0), True
    if estimator == "reinforce_pp" and bool(trained.any()):
        counts = torch.ones_like(adv) if token_counts is None else token_counts.float()
        adv[trained] = _token_whiten(adv[trained], counts[trained], eps)
    return adv, trained


def kl_shaped_rewards(rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-token rewards with the KL penalty in the reward (PPO-RLHF: Ziegler et al. 2019, Ouyang et al.
    2022): the outcome reward on each row's last response token (``outcome_token_rewards``) minus
    ``coef * sg(kl_t)`` on every response token.

    With ``kl_t = log pi(a_t) - log pi_ref(a_t)`` of on-policy tokens, the policy-gradient term's expected
    gradient is then that of ``E[r] - coef * KL(pi || pi_ref)`` of the whole response (the score function
    of ``x``: ``E[x grad log pi] = grad KL(pi || pi_ref)``, since ``E[grad x] = 0``).

    Args:
        rewards: ``[B]`` float, one outcome reward per row.
        kl: ``[B, T]`` float, per-token ``x`` (detached here; any value off ``mask``).
        mask: ``[B, T]`` bool, response tokens.
        coef: ``beta >= 0``.

    Returns:
        ``[B, T]`` float32, 0 off ``mask``. The outcome estimators use its row sums as returns.

    Raises:
        ValueError: shapes disagree, ``mask`` is not bool, or ``coef < 0``.
    """
    if kl.shape != mask.shape:
        raise ValueError(f"kl has shape {tuple(kl.shape)}; expected {tuple(mask.shape)}")
    if coef < 0:
        raise ValueError(f"coef ({coef}) must be >= 0")
    token_rewards = outcome_token_rewards(rewards, mask)
    penalty = torch.where(mask, kl.detach().float(), torch.zeros_like(token_rewards))
    return token_rewards - coef * penalty


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl's ``overlong_buffer``), per response.

    With ``L_max = max_len`` and ``L_cache = buffer_len``::

        0                                        |y| <= L_max - L_cache
        (L_max - L_cache - |y|) / L_cache * f    L_max - L_cache < |y| <= L_max
        -f                                       |y| > L_max

    Args:
        lengths: ``[B]`` int, response token counts ``|y|``.
        max_len: ``L_max``, the generation budget in tokens, ``> buffer_len``.
        buffer_len: ``L_cache >= 1`` tokens.
        factor: ``f > 0``, the penalty at ``|y| = L_max``.

    Returns:
        ``[B]`` float32 penalties in ``[-f, 0]``, to add to the rewards before the advantages.

    Raises:
        ValueError: ``buffer_len < 1``, ``buffer_len >= max_len``, ``factor <= 0``, or ``lengths`` not 1-D.
    """
    if not 1 <= buffer_len < max_len:
        raise ValueError(f"buffer_len ({buffer_len}) must be >= 1 and < max_len ({max_len})")
    if factor <= 0:
        raise ValueError(f"factor ({factor}) must be > 0")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be [B]; got shape {tuple(lengths.shape)}")
    exceed = lengths.double() - (max_len - buffer_len)
    penalty = (-exceed / buffer_len * factor).clamp(min=-factor, max=0.0)
    return penalty.float()


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each trajectory's outcome reward on its last response token (the GAE reward layout).

    Args:
        rewards: ``[B]`` float, one reward per trajectory.
        mask: ``[B, T]`` bool, True on response tokens.

    Returns:
        ``[B, T]`` float32: ``rewards[b]`` at the last True index of row ``b``, 0 elsewhere (a row
        without response tokens gets no reward).

    Raises:
        ValueError: shapes disagree or ``mask`` is not bool.
    """
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a [B, T] bool tensor; got {tuple(mask.shape)} {mask.dtype}")
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; expected ({mask.shape[0]},)")
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values  # [B]
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has = last >= 0
    out[has.nonzero().flatten(), last[has]] = rewards.float()[has]
    return out


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over each row's response tokens.

    Over a row's valid tokens (``mask`` True), with ``n(t)`` the next valid token after ``t`` and the row's last
    valid token terminal (``V = 0``, ``A = 0`` after it)::

        delta_t = r_t + gamma * V_{n(t)} - V_t
        A_t     = delta_t + gamma * lam * A_{n(t)}
        R_t     = A_t + V_t                                   # the value target ("returns")

    The valid tokens may be several spans: a multi-turn episode's model turns with the environment's observation
    tokens (mask False) between them, as ``learner.batch.TrainBatch`` builds it. Value and advantage carry across
    the masked tokens unchanged, so the outcome reward on the episode's last token reaches every earlier turn and
    the discount counts model tokens only — verl's ``compute_gae_advantage_return`` (``core_algos.py``), which
    skips observation tokens the same way. A reward on a masked token is ignored. Both outputs are 0 where
    ``mask`` is False.

    Args:
        rewards: ``[B, T]`` float, per-token rewards (outcome reward on the last token, see
            ``outcome_token_rewards``).
        values: ``[B, T]`` float, the critic's ``V(s_t)`` (detached here).
        mask: ``[B, T]`` bool.
        gamma: discount in ``[0, 1]``.
        lam: GAE lambda in ``[0, 1]`` (0: one-step TD, 1: Monte-Carlo return minus ``V``).

    Returns:
        ``(advantages, returns)``, each ``[B, T]`` float32.

    Raises:
        ValueError: shapes disagree, ``mask`` is not bool, or ``gamma``/``lam`` outside ``[0, 1]``.
    """
    if mask.dtype != torch.bool or rewards.shape != mask.shape or values.shape != mask.shape or mask.dim() != 2:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask {tuple(mask.shape)} "
            f"({mask.dtype}) must all be [B, T] with a bool mask"
        )
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"{name} ({x}) must lie in [0, 1]")
    m = mask.float()
    r = rewards.float() * m
    v = values.detach().float() * m
    advantages = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])  # V and A of the next valid token (0 after the row's last one)
    next_adv = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        m_t = m[:, t]
        adv_t = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
        advantages[:, t] = adv_t * m_t
        # a masked token (prompt, observation, padding) passes the next valid token's V and A through
        next_value = m_t * v[:, t] + (1 - m_t) * next_value
        next_adv = m_t * adv_t + (1 - m_t) * next_adv
    return advantages, (advantages + v) * m
