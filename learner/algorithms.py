"""Pure torch functions of the RL algorithm, and the stable import path for them.

``token_logprobs`` lives here; the advantage estimators are in ``learner.advantages`` and the loss
terms in ``learner.losses``, re-exported below so ``from learner.algorithms import grpo_advantages,
policy_loss, token_logprobs`` keeps working. No state, no distributed code.
"""

from __future__ import annotations

import torch

from learner.advantages import (  # noqa: F401  (re-exported)
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    outcome_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from learner.losses import kl_penalty, policy_loss, token_entropy, value_loss  # noqa: F401  (re-exported)

__all__ = [
    "dr_grpo_advantages", "gae", "grpo_advantages", "kl_penalty", "outcome_advantages", "policy_loss",
    "reinforce_pp_advantages", "rloo_advantages", "token_entropy", "token_logprobs", "value_loss",
]


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
