"""Step-start quantities (the critic's ``V_old``, the KL in the reward) are computed with dropout off:
``eval_mode`` makes two forwards of a dropout model agree and restores every module's own training flag."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from learner.algorithms import token_logprobs
from learner.step_start import eval_mode


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
