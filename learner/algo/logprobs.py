"""Per-token log-probabilities of the sampled tokens under the policy's logits. Pure torch, no state."""

from __future__ import annotations

import torch
import torch.utils.checkpoint


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


def _slice_stats(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                 entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    z = head(hidden).float()  # [c, V]: the only full-vocabulary tensor, one slice at a time
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logprobs = torch.gather(z, -1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not entropy:
        return logprobs, torch.zeros_like(logprobs)
    return logprobs, lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def chunked_token_stats(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                        chunk: int = 1024, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability (and entropy) of the next token at ``n`` positions without their whole logits.

    The LM head runs on ``chunk`` positions at a time; with autograd on, each slice is recomputed in backward
    (``torch.utils.checkpoint``, non-reentrant) instead of saved, so the ``[n, V]`` float32 logits never exist
    whole in forward or backward: peak memory is ``chunk * V * 4`` bytes (a few such buffers), not ``n * V * 4``.
    The gradient is exact (the same ops, recomputed), as in Liger kernel's fused linear cross-entropy and verl's
    chunked logprobs; the saved state is ``hidden`` itself.

    Args:
        head: the LM head (``model.get_output_embeddings()``), ``[*, H] -> [*, V]``.
        hidden: ``[n, H]`` final hidden states (after the model's last norm) at the scoring positions.
        targets: ``[n]`` int64, the token each position scores.
        temperature: divides the logits (the rollout's sampling temperature).
        chunk: positions per slice (``LearnerConfig.logits_chunk``).
        entropy: also return each position's entropy ``H = logsumexp(z) - sum softmax(z) z`` (nats) of the whole
            next-token distribution (``learner.algo.losses.token_entropy``'s value; differentiable).

    Returns:
        ``(logprobs [n] float32, entropy [n] float32 or None)``; same values as ``token_logprobs`` /
        ``token_entropy`` on full logits (float32 after the head's matmul in ``hidden``'s dtype).

    Raises:
        ValueError: ``hidden`` and ``targets`` disagree on ``n``, or ``chunk < 1``.
    """
    if hidden.shape[0] != targets.shape[0] or hidden.dim() != 2:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [n, H] with targets {tuple(targets.shape)} [n]")
    if chunk < 1:
        raise ValueError(f"chunk {chunk} must be >= 1")
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    lps, ents = [], []
    for lo in range(0, hidden.shape[0], chunk):
        h, t = hidden[lo:lo + chunk], targets[lo:lo + chunk]
        if grad:
            lp, ent = torch.utils.checkpoint.checkpoint(_slice_stats, head, h, t, temperature, entropy,
                                                        use_reentrant=False)
        else:
            lp, ent = _slice_stats(head, h, t, temperature, entropy)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if entropy else None)
    return torch.cat(lps), (torch.cat(ents) if entropy else None)
