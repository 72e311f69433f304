"""Per-token log-probabilities of the sampled tokens under the policy's logits. Pure torch, no state."""

from __future__ import annotations

import torch


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
