"""Step-start quantities are computed with dropout off: ``has_dropout`` finds HF attention dropout (applied
functionally, outside any dropout module) and dropout modules; ``eval_mode`` makes two forwards of a dropout
model agree and restores every module's own training flag. (The engine's use of it, proximal logprobs of a
dropout model, is ``tests/integration/test_learner_algorithms.py``.)"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from learner.algorithms import token_logprobs
from learner.step_start import eval_mode, has_dropout


def _llama(attention_dropout: float) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         attention_dropout=attention_dropout)
    return LlamaForCausalLM(config)


def _logprobs(model, ids):
    with torch.no_grad():
        return token_logprobs(model(input_ids=ids).logits, ids)


def test_has_dropout_reads_hf_attention_dropout_and_dropout_modules():
    assert has_dropout(_llama(0.5)) and not has_dropout(_llama(0.0))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32))
    assert has_dropout(gpt2)  # nn.Dropout modules (resid/embd/attn_pdrop 0.1)
    no_drop = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0))
    assert not has_dropout(no_drop)
    assert has_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))
    read_in_forward = torch.nn.Linear(2, 2)  # a model that reads its config's dropout only in forward
    read_in_forward.config = LlamaConfig(attention_dropout=0.1)
    assert has_dropout(read_in_forward)
    read_in_forward.config = LlamaConfig()
    assert not has_dropout(read_in_forward)


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
