"""The learner's memory estimate (``learner.memory_estimate``): parameter counts from config numbers equal the
meta-device model's, the activation formula matches the tensors autograd saves, and each part of a ZeRO stage's
estimate is the hand-computed number for Qwen2.5-1.5B's shape."""

import json

import pytest
import torch

from gyre.learner.memory_estimate import (BUCKET_ELEMENTS, GIB, _count_on_meta, count_parameters, estimate,
                                          model_shape)

QWEN25_15B = {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
              "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "architectures": ["Qwen2ForCausalLM"]}
SMALL = {"hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 704, "vocab_size": 1000}


def test_qwen25_15b_from_its_config_json_has_1_54_b_parameters(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_15B))
    shape = model_shape(json.loads((tmp_path / "config.json").read_text()))
    # embedding 151936 x 1536 (tied) + 28 layers x (q 1536x1536+1536, k and v 1536x256+256, o 1536x1536,
    # MLP 3 x 1536 x 8960, two norms 2 x 1536) + final norm 1536
    layer = (1536 * 1536 + 1536) + 2 * (1536 * 256 + 256) + 1536 * 1536 + 3 * 1536 * 8960 + 2 * 1536
    assert layer == 46_797_824
    assert shape.params == 151936 * 1536 + 28 * layer + 1536 == 1_543_714_304
    assert (shape.layers, shape.hidden, shape.head_dim, shape.kv_heads, shape.vocab) == (28, 1536, 128, 2, 151936)
    assert shape.largest_block == 151936 * 1536  # the embedding is larger than a layer


@pytest.mark.parametrize("config", [
    {"model_type": "qwen2", **SMALL, "tie_word_embeddings": True},
    {"model_type": "qwen2", **SMALL, "tie_word_embeddings": False},
    {"model_type": "llama", **SMALL, "attention_bias": True, "mlp_bias": True},
    {"model_type": "llama", **SMALL, "head_dim": 96, "tie_word_embeddings": True},
    {"model_type": "mistral", **SMALL, "head_dim": 32},
    {"model_type": "qwen3", **SMALL, "head_dim": 128, "tie_word_embeddings": True},
    {"model_type": "qwen3", **SMALL, "head_dim": 128, "attention_bias": True},
], ids=["qwen2-tied", "qwen2-untied", "llama-biases", "llama-head_dim", "mistral", "qwen3", "qwen3-bias"])
def test_counting_from_the_numbers_equals_the_meta_device_model(config):
    assert count_parameters(config) == _count_on_meta(config)


def test_another_model_type_is_counted_on_the_meta_device_with_its_own_names():
    shape = model_shape({"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 1000,
                         "n_positions": 64})
    # wte 1000x128 (tied head) + wpe 64x128 + 2 x (2 norms 4x128, qkv 128x384+384, proj 128x128+128,
    # fc 128x512+512, proj 512x128+128) + final norm 2x128
    layer = 4 * 128 + 128 * 384 + 384 + 128 * 128 + 128 + 128 * 512 + 512 + 512 * 128 + 128
    assert shape.params == 1000 * 128 + 64 * 128 + 2 * layer + 2 * 128
    assert (shape.hidden, shape.layers, shape.intermediate) == (128, 2, 512)  # n_inner unset: 4 h


def test_missing_numbers_and_unknown_types_are_named():
    with pytest.raises(ValueError, match=r"lacks integer num_hidden_layers, vocab_size"):
        model_shape({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 2})
    with pytest.raises(ValueError, match=r"model_type 'no-such-type' is not one transformers knows"):
        model_shape({"model_type": "no-such-type", "hidden_size": 64})


def _saved_bytes(config: dict, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves in one forward of the decoder stack."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation="sdpa").to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=torch.randint(0, config["vocab_size"], (1, tokens)))
    return sum(saved.values())


@pytest.mark.parametrize("model_type, extra, dtype", [
    ("qwen2", {}, torch.bfloat16), ("llama", {}, torch.bfloat16), ("mistral", {}, torch.bfloat16),
    ("qwen3", {"head_dim": 64}, torch.bfloat16), ("qwen2", {}, torch.float32),
])
def test_activation_formula_matches_what_autograd_saves(model_type, extra, dtype):
    config = {"model_type": model_type, **SMALL, **extra, "intermediate_size": 1024, "num_hidden_layers": 4}
    shape, tokens = model_shape(config), 256
    formula = shape.layers * shape.activation_bytes_per_token_layer(2 if dtype == torch.bfloat16 else 4) * tokens
    assert _saved_bytes(config, tokens, dtype) == pytest.approx(formula, rel=0.05)


def test_zero2_bf16_parts_for_qwen25_15b_by_hand():
    shape, p = model_shape(QWEN25_15B), 1_543_714_304
    est = estimate(shape, zero_stage=2, dtype="bf16", world_size=4, tokens=16384, gradient_checkpointing=True,
                   logits_chunk=1024)
    # per token and layer: attention 2 (1536 + 3 x 1536 + 3 x 256), MLP 2 (1536 + 4 x 8960), norms 2 (4 + 2) 1536
    a = 2 * (1536 + 3 * 1536 + 3 * 256) + 2 * (1536 + 4 * 8960) + 2 * 6 * 1536
    assert shape.activation_bytes_per_token_layer(2) == a == 107_008
    assert est.weights == 2 * p
    assert est.gradients == 4 * p // 4 + 2 * BUCKET_ELEMENTS
    assert est.optimizer == 12 * p // 4 and est.host == 0 and est.reference == 0
    assert est.activations == 28 * 16384 * 1536 * 2 + 2 * a * 16384
    assert est.logits == 1024 * 151936 * 4
    assert est.total / GIB == pytest.approx(14.72, abs=0.01)


def test_each_stage_partitions_what_zero_says_and_offload_moves_the_optimizer():
    shape, p, n = model_shape(QWEN25_15B), 1_543_714_304, 8

    def at(stage, dtype="bf16", **kw):
        return estimate(shape, zero_stage=stage, dtype=dtype, world_size=n, tokens=4096,
                        gradient_checkpointing=True, logits_chunk=1024, **kw)

    z0, z1, z2, z3 = (at(s) for s in range(4))
    assert z0.optimizer == 12 * p and z1.optimizer == z2.optimizer == z3.optimizer == 12 * p // n
    assert z0.gradients == z1.gradients == 6 * p + 2 * BUCKET_ELEMENTS  # bf16 grads + fp32 accumulation, whole
    assert z2.gradients == 4 * p // n + 2 * BUCKET_ELEMENTS and z3.gradients == 4 * p // n + 4 * BUCKET_ELEMENTS
    assert z0.weights == z2.weights == 2 * p and z3.weights == 2 * p // n + 2 * 2 * shape.largest_block
    assert z0.activations == z3.activations
    off = at(3, offload_optimizer="cpu")
    assert off.optimizer == 0 and off.host == 12 * p // n and off.total == z3.total - z3.optimizer
    assert at(0, offload_optimizer="cpu") == z0  # ZeRO-0 cannot offload
    assert at(2, dtype="fp32").optimizer == 8 * p // n  # fp32: the weights are the master copy
    assert at(2, reference_model=True).reference == 2 * p  # a full copy, like the policy
    assert at(3, reference_model=True).reference == 2 * p // n + 2 * 2 * shape.largest_block  # sharded like it
    assert at(3, reference_model=True, offload_optimizer="cpu").reference == 2 * 2 * shape.largest_block


def test_without_checkpointing_every_layer_keeps_its_activations():
    shape = model_shape(QWEN25_15B)
    kept = estimate(shape, zero_stage=2, dtype="bf16", world_size=1, tokens=1000, gradient_checkpointing=False,
                    logits_chunk=1)
    assert kept.activations == 29 * 107_008 * 1000


@pytest.mark.parametrize("kwargs, message", [
    ({"zero_stage": 4}, r"zero_stage \(4\) must be 0, 1, 2 or 3"),
    ({"tokens": 0}, r"tokens \(0\) must be >= 1"),
    ({"world_size": 0}, r"world_size \(0\) must be >= 1"),
])
def test_bad_arguments_are_named(kwargs, message):
    args = {"zero_stage": 2, "dtype": "bf16", "world_size": 1, "tokens": 1, "gradient_checkpointing": True,
            "logits_chunk": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        estimate(model_shape(QWEN25_15B), **args)
