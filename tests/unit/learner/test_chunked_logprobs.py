"""``chunked_token_stats``: the LM head's ``[tokens, V]`` float32 logits never exist whole.

Every tensor any op creates during the logprob computation, forward and backward, is recorded (a
``TorchDispatchMode``); the largest grows with ``chunk``, not with ``tokens * V``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gyre.learner.algo.logprobs import chunked_token_stats, token_logprobs
from gyre.learner.algo.losses import token_entropy

V, H, N = 3000, 16, 400


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _head_and_hidden():
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(N, H, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    return head, hidden, targets


def _largest(chunk: int) -> int:
    head, hidden, targets = _head_and_hidden()
    with _LargestTensor() as mode:
        lp, ent = chunked_token_stats(head, hidden, targets, 1.0, chunk, entropy=True)
        (lp.sum() + ent.sum()).backward()
    return mode.largest


def test_peak_grows_with_the_chunk_not_with_tokens_times_vocab():
    small, large = _largest(16), _largest(64)
    assert small <= 16 * V < N * V // 10  # one slice's logits is the largest tensor
    assert large == 64 * V  # four times the chunk, four times the peak
    assert _largest(N) >= N * V  # the control: one slice is the whole [N, V]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_equal_the_full_logits(temperature):
    head, hidden, targets = _head_and_hidden()
    lp, ent = chunked_token_stats(head, hidden, targets, temperature, chunk=7, entropy=True)
    (lp * 0.3 + ent).sum().backward()
    chunked_grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    logits = head(hidden).unsqueeze(0)  # [1, N, V]; position j scores ids[j + 1]
    ids = torch.cat([torch.zeros(1, dtype=torch.long), targets]).unsqueeze(0)
    logits = torch.cat([logits, torch.zeros(1, 1, V)], dim=1)
    full_lp = token_logprobs(logits, ids, temperature)[0]
    full_ent = token_entropy(logits, torch.ones(1, N, dtype=torch.bool), temperature)[0]
    (full_lp * 0.3 + full_ent).sum().backward()
    torch.testing.assert_close(lp, full_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, full_ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked_grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_grads[1], head.weight.grad, atol=1e-5, rtol=1e-5)


def test_mismatched_shapes_are_refused():
    head, hidden, targets = _head_and_hidden()
    with pytest.raises(ValueError, match=r"hidden \(400, 16\) must be \[n, H\] with targets \(5,\)"):
        chunked_token_stats(head, hidden, targets[:5])
