"""One packed forward of a micro-batch: per-token logprobs, entropy and values, without padding or full logits.

The model runs on ``learner.packing.PackedRows`` (rows end to end, attention within rows) and returns its last
hidden states only (``logits_to_keep`` empty: the HF head is skipped); the LM head then runs on the response
positions alone, ``logits_chunk`` at a time (``learner.algo.logprobs.chunked_token_stats``). Everything comes
back in the learner's ``[b, W - 1]`` layout (``W``: the micro-batch's longest row), aligned with
``TrainBatch.response_mask``: index ``j`` of a row scores its token ``j + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyre.learner.algo.logprobs import chunked_token_stats
from gyre.learner.packing import PackedRows


@dataclass(frozen=True)
class MicroPass:
    """A micro-batch forward's per-token outputs, each ``[b, W - 1]`` float32 on the model's device."""

    logprobs: torch.Tensor
    """``log pi(token j + 1 | prefix)`` under ``softmax(logits / temperature)``; 0 off ``mask``."""

    mask: torch.Tensor
    """``[b, W - 1]`` bool: the response tokens scored (``TrainBatch.response_mask`` of the rows, trimmed)."""

    entropy: torch.Tensor | None = None
    """Entropy (nats) of the whole next-token distribution at each scored place; 0 off ``mask``."""

    values: torch.Tensor | None = None
    """The critic's ``V`` of the state after ``input_ids[:, :j + 1]`` at every real position (0 past a row's end)."""


def packed_pass(model: torch.nn.Module, packed: PackedRows, mask: torch.Tensor, temperature: float, chunk: int,
                entropy: bool = False, value_head: torch.nn.Module | None = None) -> MicroPass:
    """Run ``model`` on ``packed`` and score the places ``mask`` selects.

    Args:
        model: a causal LM loaded with a packed attention kernel (``learner.packing``), or a DeepSpeed engine
            wrapping one (its ``module`` holds the LM head).
        packed: the micro-batch.
        mask: ``[b, W - 1]`` bool, the places to score (response tokens).
        temperature: divides the logits.
        chunk: LM-head positions per slice (``LearnerConfig.logits_chunk``).
        entropy: also compute the entropy (differentiable).
        value_head: the critic's ``Linear(H, 1)`` on the last hidden state, or None.

    Returns:
        The ``MicroPass``; differentiable where autograd is on.
    """
    device = packed.input_ids.device
    out = model(**packed.model_kwargs(), logits_to_keep=torch.empty(0, dtype=torch.long, device=device),
                output_hidden_states=True)
    hidden = out.hidden_states[-1][0]  # [N, H], after the final norm
    mask = mask & packed.valid
    pos, targets = packed.targets(mask)
    head = getattr(model, "module", model).get_output_embeddings()
    lp, ent = chunked_token_stats(head, hidden[pos], targets, temperature, chunk, entropy)
    values = None
    if value_head is not None:
        values = packed.gather(value_head(hidden).squeeze(-1).float())
    return MicroPass(logprobs=packed.unpack(lp, mask), mask=mask,
                     entropy=None if ent is None else packed.unpack(ent, mask), values=values)
