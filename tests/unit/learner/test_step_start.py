"""Step-start quantities (the critic's ``V_old``, the KL in the reward) are computed with dropout off:
``eval_mode`` makes two forwards of a dropout model agree and restores every module's own training flag."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gyre.learner.algo.logprobs import token_logprobs
from gyre.learner.config import AlgorithmConfig
from gyre.learner.step_start import eval_mode, mini_batch_rows, proximal_logprobs


def _llama(attention_dropout: float) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         attention_dropout=attention_dropout)
    return LlamaForCausalLM(config)


def _logprobs(model, ids):
    with torch.no_grad():
        return token_logprobs(model(input_ids=ids).logits, ids)


def test_two_step_start_forwards_of_a_dropout_model_agree():
    model = _llama(0.5).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    # the control: in train mode the forward is a random draw
    assert not torch.equal(_logprobs(model, ids), _logprobs(model, ids))
    rng = torch.get_rng_state()
    with eval_mode(model):
        first = _logprobs(model, ids)
    with eval_mode(model):
        second = _logprobs(model, ids)
    assert torch.equal(first, second)
    assert torch.equal(torch.get_rng_state(), rng), "a dropout-off forward drew from the RNG"
    assert model.training and all(m.training for m in model.modules())


def test_eval_mode_restores_each_modules_own_flag_even_on_error():
    model = _llama(0.5).train()
    model.model.layers[1].eval()  # a submodule someone keeps in eval
    with pytest.raises(RuntimeError, match="boom"), eval_mode(model):
        assert not any(m.training for m in model.modules())
        raise RuntimeError("boom")
    assert model.training and model.model.layers[0].training and not model.model.layers[1].training


class _Learner:
    """Test double of the ``LearnerEngine`` members ``proximal_logprobs`` uses."""

    def __init__(self, model):
        self.engine = model
        self.algo = AlgorithmConfig()

    def _pass(self, batch, rows, entropy=False):
        mask = batch.attention_mask[rows]
        length = int(mask.sum(dim=1).max())
        ids = batch.input_ids[rows, :length]
        logits = self.engine(input_ids=ids, attention_mask=mask[:, :length]).logits
        return SimpleNamespace(logprobs=token_logprobs(logits, ids) * batch.response_mask[rows, : length - 1])


def test_proximal_logprobs_are_the_dropout_off_policy_before_the_first_update():
    """Finding #21.6: the PPO anchor of a multi-update step comes from a dropout-off pass (deterministic, the
    network vLLM samples from), over the given micro-batches only, and leaves the model in train mode."""
    model = _llama(0.5).train()
    ids = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(2))
    attention = torch.ones_like(ids)
    attention[3, 7:] = 0  # a shorter row, right-padded
    batch = SimpleNamespace(input_ids=ids, attention_mask=attention,
                            response_mask=torch.ones(4, 9, dtype=torch.bool))
    learner = _Learner(model)
    prox = proximal_logprobs(learner, batch, [torch.tensor([0, 1]), torch.tensor([3])])
    assert torch.equal(prox, proximal_logprobs(learner, batch, [torch.tensor([0, 1]), torch.tensor([3])]))
    with eval_mode(model):
        torch.testing.assert_close(prox[:2], _logprobs(model, ids[:2]), atol=1e-6, rtol=0)
        torch.testing.assert_close(prox[3:, :6], _logprobs(model, ids[3:, :7]), atol=1e-6, rtol=0)
    assert torch.equal(prox[2], torch.zeros(9)) and torch.equal(prox[3, 6:], torch.zeros(3))
    assert model.training and all(m.training for m in model.modules())


def test_mini_batch_rows_split_evenly_or_refuse():
    assert mini_batch_rows(6, 2) == [range(0, 3), range(3, 6)]
    assert mini_batch_rows(6, 1) == [range(0, 6)]
    with pytest.raises(ValueError, match="6 rows cannot be split into 4 equal mini-batches"):
        mini_batch_rows(6, 4)
