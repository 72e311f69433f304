"""Packed micro-batches (``learner.packing``, ``learner.forward``) score exactly what the padded batch scores.

The padded reference is the HF model with SDPA and an attention mask, logprobs from its full logits
(``token_logprobs``). The packed pass concatenates the rows, restarts ``position_ids`` and attends within rows
only (``per_row`` kernel), and computes logprobs from the last hidden state in LM-head slices. In fp32 the two
agree to ``ATOL`` in values and gradients, for a Llama and a Qwen2 (GQA, attention bias), rows of length 2 and
multi-turn loss masks. A kernel that lets tokens attend across rows is caught (the control test).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from gyre.learner.algo.logprobs import token_logprobs
from gyre.learner.algo.losses import token_entropy
from gyre.learner.forward import packed_pass
from gyre.learner.packing import PACKED_ATTENTION, PackedKernelError, PackedRows, packed_attn_implementation

ATOL = 2e-5
"""fp32: the packed and padded paths run the same ops on the same numbers but reduce in other orders."""
LEAKY = "test_leaky_packed"


def _leaky(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """A planted bug: causal attention over the whole packed sequence (rows see the rows before them)."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(LEAKY, _leaky)


def _models(kind: str, attn: str):
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    if kind == "llama":
        padded = LlamaForCausalLM(LlamaConfig(**common, attn_implementation="sdpa"))
        packed = LlamaForCausalLM(LlamaConfig(**common, attn_implementation=attn))
    else:
        padded = Qwen2ForCausalLM(Qwen2Config(**common, attn_implementation="sdpa"))
        packed = Qwen2ForCausalLM(Qwen2Config(**common, attn_implementation=attn))
    packed.load_state_dict(padded.state_dict())
    return padded.float(), packed.float()


def _batch():
    """Four right-padded rows of lengths 9, 2, 6, 11; response masks with a hole (a multi-turn row's tool output)."""
    g = torch.Generator().manual_seed(3)
    lengths = [9, 2, 6, 11]
    ids = torch.randint(1, 97, (4, 11), generator=g)
    attention = (torch.arange(11).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    ids = ids * attention  # pad id 0
    response = torch.zeros(4, 10, dtype=torch.bool)
    response[0, 3:8] = True
    response[0, 5] = False  # a multi-turn row: an environment token inside the response
    response[1, 0] = True  # a row of length 2: one scored token
    response[2, 1:5] = True
    response[3, 2:10] = True
    response[3, 4:6] = False
    return ids, attention, response


def _padded_stats(model, ids, attention, response):
    logits = model(input_ids=ids, attention_mask=attention).logits
    return token_logprobs(logits, ids), token_entropy(logits, response)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_logprobs_entropy_and_gradients_equal_the_padded_ones(kind):
    padded, packed = _models(kind, PACKED_ATTENTION["per_row"])
    ids, attention, response = _batch()
    weights = torch.randn(response.shape, generator=torch.Generator().manual_seed(4))
    lp_ref, ent_ref = _padded_stats(padded, ids, attention, response)
    ((lp_ref * weights)[response].sum() + ent_ref[response].sum()).backward()

    rows = torch.tensor([2, 0, 3, 1])  # any order
    pack = PackedRows.build(ids, attention, rows, "cpu")
    assert pack.tokens == 28 and pack.max_len == 11 and pack.position_ids[0, 15:17].tolist() == [0, 1]
    out = packed_pass(packed, pack, response[rows], temperature=1.0, chunk=3, entropy=True)
    ((out.logprobs * weights[rows])[out.mask].sum() + out.entropy[out.mask].sum()).backward()

    torch.testing.assert_close(out.logprobs[out.mask], lp_ref[rows][response[rows]], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.entropy[out.mask], ent_ref[rows][response[rows]], atol=ATOL, rtol=0)
    assert torch.equal(out.logprobs[~out.mask], torch.zeros_like(out.logprobs[~out.mask]))
    for (name, a), b in zip(padded.named_parameters(), packed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=ATOL, rtol=1e-4, msg=f"gradient of {name}")


def test_a_kernel_that_attends_across_rows_is_caught():
    """The control: with a leak across rows the packed logprobs leave the padded ones' tolerance."""
    padded, leaky = _models("llama", LEAKY)
    ids, attention, response = _batch()
    lp_ref, _ = _padded_stats(padded, ids, attention, response)
    rows = torch.arange(4)
    out = packed_pass(leaky, PackedRows.build(ids, attention, rows, "cpu"), response, 1.0, chunk=4)
    later = response.clone()
    later[0] = False  # the first row sees no other row even with the leak
    assert (out.logprobs - lp_ref)[later].abs().max() > 100 * ATOL


def test_temperature_divides_the_logits():
    padded, packed = _models("llama", PACKED_ATTENTION["per_row"])
    ids, attention, response = _batch()
    logits = padded(input_ids=ids, attention_mask=attention).logits
    with torch.no_grad():
        out = packed_pass(packed, PackedRows.build(ids, attention, torch.arange(4), "cpu"), response, 0.7, chunk=5)
    torch.testing.assert_close(out.logprobs[response], token_logprobs(logits, ids, 0.7)[response], atol=ATOL,
                               rtol=0)


def test_a_packed_model_refuses_padded_input_and_takes_unpadded_rows():
    _, packed = _models("llama", PACKED_ATTENTION["per_row"])
    ids, attention, _ = _batch()
    with pytest.raises(ValueError, match="given padded rows"):
        packed(input_ids=ids, attention_mask=attention)
    padded, _ = _models("llama", PACKED_ATTENTION["per_row"])
    whole = ids[:, :6]  # unpadded rows without a mask: each one sequence
    torch.testing.assert_close(packed(input_ids=whole).logits, padded(input_ids=whole).logits, atol=ATOL, rtol=0)


def test_a_row_too_short_to_score_is_refused():
    ids, attention, _ = _batch()
    attention[1, 1] = 0
    with pytest.raises(ValueError, match="row 1 has 1 real tokens"):
        PackedRows.build(ids, attention, torch.tensor([0, 1]), "cpu")


def test_varlen_on_a_cpu_names_the_fallback():
    with pytest.raises(PackedKernelError, match="needs a CUDA device.*'auto'.*per_row"):
        packed_attn_implementation("varlen", "cpu", torch.bfloat16)
    assert packed_attn_implementation("auto", "cpu", torch.bfloat16) == PACKED_ATTENTION["per_row"]


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    """A CPU stand-in for ``varlen_attn`` (``[N, H, D]`` in and out, causal within each ``cu`` span); records the
    keyword arguments it was called with."""
    CALLS.append(kw)
    gqa = kw.get("enable_gqa", False)
    bounds = cu_q.tolist()
    outs = [F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                           is_causal=True, scale=kw.get("scale"), enable_gqa=gqa).transpose(0, 1)
            for a, b in zip(bounds, bounds[1:])]
    return torch.cat(outs)


CALLS: list[dict] = []


def _varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False):
    assert window_size == (-1, 0)
    return _reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, enable_gqa=enable_gqa)


def _varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False):
    assert is_causal and key.shape[1] == query.shape[1]  # no GQA here: the heads were repeated
    return _reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)


@pytest.mark.parametrize("fake", [_varlen_2_11, _varlen_2_10], ids=["torch-2.11", "torch-2.10"])
def test_the_varlen_kernel_gets_packed_rows_in_its_layout(monkeypatch, fake):
    """The CUDA kernel cannot run here: a stand-in with its signature (torch 2.11's window_size and enable_gqa, or
    2.10's is_causal without GQA) shows the glue hands it ``[N, H, D]`` rows with causal spans and GQA handled."""
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", fake)
    CALLS.clear()
    padded, packed = _models("qwen2", PACKED_ATTENTION["varlen"])
    ids, attention, response = _batch()
    lp_ref, _ = _padded_stats(padded, ids, attention, response)
    with torch.no_grad():
        out = packed_pass(packed, PackedRows.build(ids, attention, torch.arange(4), "cpu"), response, 1.0, chunk=8)
    torch.testing.assert_close(out.logprobs[response], lp_ref[response], atol=ATOL, rtol=0)
    assert len(CALLS) == 2  # one call per layer
