"""How much accelerator memory one learner rank needs, from the model's config numbers and the engine settings,
without loading a weight: what ``gyre run --dry-run`` prints to choose a ZeRO stage that fits.

Every figure is bytes on one data-parallel rank (``N`` ranks, ``P`` parameters, ``b`` bytes per parameter and
activation element: 2 with ``bf16``, 4 with ``fp32``). The model of DeepSpeed's memory follows ZeRO (Rajbhandari
et al. 2020, §3: ``K = 12`` bytes of optimizer state per parameter in mixed precision) and what gyre's DeepSpeed
config asks for (``learner.ds_setup.build_ds_config``: torch AdamW, ``grad_accum_dtype: fp32`` with bf16 and
ZeRO >= 1, DeepSpeed's default buckets):

- **weights**: ``b P``; ZeRO-3 ``b P / N`` plus the parameters it gathers for compute, counted as the two largest
  blocks (the one running and the one prefetched; a block is a decoder layer or the embedding).
- **gradients**: ZeRO-0/1 keep every gradient: ``b P`` in the model dtype plus ``4 P`` of fp32 accumulation
  with bf16 (DeepSpeed's bf16 optimizer), ``4 P`` with fp32. ZeRO-2/3 keep only this rank's fp32 partition,
  ``4 P / N``. Plus the reduce bucket, ``b`` times DeepSpeed's default 5e8 elements (at most ``P`` for ZeRO-0/1,
  which flatten the gradients into it; ZeRO-2 allocates it whole; ZeRO-3 twice, overlapping communication).
- **optimizer**: AdamW's two fp32 moments (8 bytes) plus, with bf16, the fp32 master weights (4): ``12 P`` or
  ``8 P``, divided by ``N`` from ZeRO-1 on; 0 on the accelerator with ``offload_optimizer: cpu`` (host memory).
- **activations** of one micro-batch of ``T`` tokens (packed rows, or rows padded to the longest; attention by
  a FlashAttention-style kernel, so no ``T x T`` score matrix is kept). Per decoder layer and token the
  tensors backward needs are, adapted from Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", §4.1: ``34 s b h + 5 a s^2 b`` per layer for GPT, here with grouped-query attention, a
  gated MLP of width ``I``, RMSNorm and no dropout):
  ``a = b (h + 3 d_q + 3 d_kv) + b (h + 4 I) + 2 (4 + b) h`` bytes — attention: the normed input, Q, K, V, the
  rotated Q and K, the attention output (``d_q = heads x head_dim``, ``d_kv = kv_heads x head_dim``); MLP: the
  normed input, gate, up, act(gate), act(gate) x up; two RMSNorms keeping their fp32 input and bf16 output
  (qwen3 adds ``(4 + b)(d_q + d_kv)``: its per-head Q and K norms). Within 5 % of the tensors autograd saves for
  llama, mistral, qwen2 and qwen3 layers (``tests/unit/learner/test_memory_estimate.py`` counts them).
  With ``gradient_checkpointing`` only each layer's input survives the forward, ``L T h b``, plus one layer's
  working set in backward: its recomputed activations and their gradients, ``2 a T``. Without it, every layer's
  ``L a T`` plus one layer's gradients, ``a T``.
- **logits**: the LM head runs ``logits_chunk`` tokens at a time in fp32: ``logits_chunk x vocab x 4``.
- **reference**: with ``kl_coef > 0`` a frozen copy of the policy, sharded like it (``learner.engine``
  ``_load_reference``): ``b P`` on every rank at ZeRO 0-2, ``b P / n`` plus the gathered blocks at ZeRO-3 (0 on the
  accelerator with ``offload_optimizer: cpu``, whose reference parameters live in host memory).

Not counted: the CUDA context and allocator fragmentation (what the headroom of a fit is for), a critic's value
head (``h + 1`` parameters). The numbers are estimates to pick a stage with, not a guarantee.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

GIB = 1 << 30
"""Bytes per GiB."""

BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size`` / ``allreduce_bucket_size`` (elements); gyre sets neither."""

ANALYTIC_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""``model_type`` values whose parameters are counted from the config's numbers (dense decoders with a gated
MLP); any other type is built on the meta device by ``transformers`` to count them."""

@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The numbers of a causal LM the estimate needs, read from its ``config.json`` (no weights)."""

    params: int
    """Trainable parameters ``P`` (tied embeddings counted once)."""
    layers: int
    """Decoder layers ``L`` (``num_hidden_layers``)."""
    hidden: int
    """Hidden size ``h`` (``hidden_size``)."""
    heads: int
    """Attention heads (``num_attention_heads``)."""
    kv_heads: int
    """Key/value heads (``num_key_value_heads``; = ``heads`` without grouped-query attention)."""
    head_dim: int
    """Width of one head (``head_dim``, else ``hidden / heads``)."""
    intermediate: int
    """MLP width ``I`` (``intermediate_size``)."""
    vocab: int
    """Vocabulary size (``vocab_size``), the LM head's width."""
    largest_block: int
    """Parameters of the largest block ZeRO-3 gathers at once: a decoder layer or the embedding."""
    qk_norm: bool = False
    """Queries and keys are RMS-normed per head (qwen3), which keeps their fp32 copies for backward too."""

    def activation_bytes_per_token_layer(self, dtype_bytes: int) -> int:
        """``a``: bytes one token keeps for backward in one decoder layer (the module docstring's formula)."""
        b, h = dtype_bytes, self.hidden
        d_q, d_kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        qk_norm = (4 + b) * (d_q + d_kv) if self.qk_norm else 0
        return b * (h + 3 * d_q + 3 * d_kv) + b * (h + 4 * self.intermediate) + 2 * (4 + b) * h + qk_norm


def _need(config: dict[str, Any], *keys: str) -> list[int]:
    missing = [k for k in keys if not isinstance(config.get(k), int)]
    if missing:
        raise ValueError(f"config.json of model_type {config.get('model_type')!r} lacks integer {', '.join(missing)}; "
                         f"expected the Hugging Face names of a decoder-only model ({', '.join(keys)})")
    return [config[k] for k in keys]


def count_parameters(config: dict[str, Any]) -> int:
    """Trainable parameters of the causal LM ``config`` (a ``config.json`` dict) describes.

    ``ANALYTIC_TYPES`` are counted from the numbers: embedding ``V h``; per layer Q/K/V/O projections
    ``h (2 d_q + 2 d_kv)`` (+ biases: Q, K, V for qwen2; all four with ``attention_bias``), gated MLP ``3 h I``
    (+ ``2 I + h`` with ``mlp_bias``), two RMSNorms ``2 h`` (+ qwen3's per-head Q/K norms ``2 head_dim``); final
    norm ``h``; an untied LM head ``V h`` (equal to the meta-device count, ``tests/unit/learner/
    test_memory_estimate.py``). Any other ``model_type`` is built with ``transformers`` on the meta device (no
    memory, no weights) and its parameters summed. The common types are counted without it because
    ``transformers``' modeling code looks for DeepSpeed when imported, and a dry run imports no engine.

    Raises:
        ValueError: a number the count needs is missing, or ``transformers`` cannot build the model type.
    """
    kind = config.get("model_type")
    if kind not in ANALYTIC_TYPES:
        return _count_on_meta(config)
    h, layers, vocab = _need(config, "hidden_size", "num_hidden_layers", "vocab_size")
    _need(config, "num_attention_heads", "intermediate_size")
    return vocab * h * (1 if config.get("tie_word_embeddings", False) else 2) + h + layers * _layer_params(config)


def _layer_params(config: dict[str, Any]) -> int:
    h, heads, inter = config["hidden_size"], config["num_attention_heads"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // heads
    d_q, d_kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    attn = h * (2 * d_q + 2 * d_kv)
    if config["model_type"] == "qwen2":
        attn += d_q + 2 * d_kv
    elif config.get("attention_bias", False):
        attn += d_q + 2 * d_kv + h
    mlp = 3 * h * inter + (2 * inter + h if config.get("mlp_bias", False) else 0)
    norms = 2 * h + (2 * head_dim if config["model_type"] == "qwen3" else 0)
    return attn + mlp + norms


def _count_on_meta(config: dict[str, Any]) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        hf_config = AutoConfig.for_model(**config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, TypeError, ImportError) as exc:
        raise ValueError(f"cannot count the parameters of model_type {config.get('model_type')!r} on the meta "
                         f"device: {str(exc).splitlines()[0][:200]}") from None
    return sum(p.numel() for p in model.parameters())


def model_shape(config: dict[str, Any]) -> ModelShape:
    """The :class:`ModelShape` of a ``config.json`` dict. Other model types than ``ANALYTIC_TYPES`` have their
    numbers read through ``transformers.AutoConfig`` (which maps e.g. GPT-2's ``n_embd`` to ``hidden_size``).

    Raises:
        ValueError: as :func:`count_parameters`, or ``num_hidden_layers`` / ``hidden_size`` /
            ``num_attention_heads`` / ``vocab_size`` missing.
    """
    numbers = config if config.get("model_type") in ANALYTIC_TYPES else _normalized(config)
    h, layers, heads, vocab = _need(numbers, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    params = count_parameters(config)
    embeddings = vocab * h * (1 if numbers.get("tie_word_embeddings", False) else 2)
    per_layer = (params - embeddings) // layers  # the embeddings aside, the rest is (nearly all) the layers
    return ModelShape(params=params, layers=layers, hidden=h, heads=heads,
                      kv_heads=numbers.get("num_key_value_heads") or heads,
                      head_dim=numbers.get("head_dim") or h // heads,
                      intermediate=numbers.get("intermediate_size") or 4 * h, vocab=vocab,
                      largest_block=max(per_layer, vocab * h), qk_norm=config.get("model_type") == "qwen3")


def _normalized(config: dict[str, Any]) -> dict[str, Any]:
    """The standard names of a config of any model type ``transformers`` knows (its ``attribute_map``)."""
    from transformers import AutoConfig

    try:
        hf = AutoConfig.for_model(**config)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"model_type {config.get('model_type')!r} is not one transformers knows: "
                         f"{str(exc).splitlines()[0][:200]}") from None
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_key_value_heads",
            "head_dim", "intermediate_size", "tie_word_embeddings")
    out = {k: getattr(hf, k, None) for k in keys}
    out["intermediate_size"] = out["intermediate_size"] or getattr(hf, "n_inner", None)
    return out


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """One learner rank's memory by part, in bytes (the module docstring gives each formula)."""

    zero_stage: int
    """The ZeRO stage estimated."""
    weights: int
    """Model weights on the accelerator (ZeRO-3: the partition plus the gathered blocks)."""
    gradients: int
    """Gradients and their fp32 accumulation, plus the reduce bucket."""
    optimizer: int
    """AdamW moments (and fp32 master weights with bf16) on the accelerator; 0 when offloaded."""
    activations: int
    """Saved activations of one micro-batch plus one layer's backward working set."""
    logits: int
    """One LM-head slice, ``logits_chunk x vocab x 4``."""
    reference: int
    """The frozen reference model of ``kl_coef > 0``, else 0."""
    host: int
    """Optimizer states in host memory (``offload_optimizer: cpu``), else 0."""

    @property
    def total(self) -> int:
        """Accelerator bytes: weights + gradients + optimizer + activations + logits + reference."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.reference


def estimate(shape: ModelShape, *, zero_stage: int, dtype: Literal["bf16", "fp32"], world_size: int, tokens: int,
             gradient_checkpointing: bool, logits_chunk: int, offload_optimizer: str = "none",
             reference_model: bool = False) -> MemoryEstimate:
    """One rank's memory for ``shape`` trained with these engine settings (``learner.config.LearnerConfig``'s
    fields of the same names).

    Args:
        shape: the model's numbers (:func:`model_shape`).
        zero_stage: 0-3; ``offload_optimizer: cpu`` only counts from stage 1 (DeepSpeed refuses it at 0).
        dtype: parameter and activation dtype.
        world_size: data-parallel ranks ``N`` the ZeRO stage partitions over.
        tokens: ``T``, tokens of one micro-batch on this rank, padding included.
        gradient_checkpointing: activations recomputed per layer in backward.
        logits_chunk: tokens per LM-head slice.
        offload_optimizer: ``none`` or ``cpu``.
        reference_model: a frozen reference copy is loaded (``learner.algorithm.kl_coef > 0``).

    Raises:
        ValueError: ``zero_stage`` outside 0-3, or ``world_size``, ``tokens`` or ``logits_chunk`` below 1.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage ({zero_stage}) must be 0, 1, 2 or 3")
    for name, value in (("world_size", world_size), ("tokens", tokens), ("logits_chunk", logits_chunk)):
        if value < 1:
            raise ValueError(f"{name} ({value}) must be >= 1")
    p, n, b = shape.params, world_size, 2 if dtype == "bf16" else 4
    weights = b * p if zero_stage < 3 else b * p // n + 2 * b * shape.largest_block
    if zero_stage < 2:
        gradients = (b + 4 if dtype == "bf16" else 4) * p + b * min(p, BUCKET_ELEMENTS)
    else:
        gradients = 4 * p // n + (1 if zero_stage == 2 else 2) * b * BUCKET_ELEMENTS
    states = (12 if dtype == "bf16" else 8) * p // (n if zero_stage >= 1 else 1)
    offloaded = offload_optimizer == "cpu" and zero_stage >= 1
    per_layer = shape.activation_bytes_per_token_layer(b) * tokens
    if gradient_checkpointing:
        activations = shape.layers * tokens * shape.hidden * b + 2 * per_layer
    else:
        activations = (shape.layers + 1) * per_layer
    return MemoryEstimate(zero_stage=zero_stage, weights=weights, gradients=gradients,
                          optimizer=0 if offloaded else states, activations=activations,
                          logits=logits_chunk * shape.vocab * 4,
                          reference=_reference_bytes(reference_model, zero_stage, offloaded, b, p, n, shape),
                          host=states if offloaded else 0)


def _reference_bytes(loaded: bool, zero_stage: int, offloaded: bool, b: int, p: int, n: int, shape) -> int:
    """Accelerator bytes of the KL reference: a full copy below ZeRO-3, a ``1 / n`` shard (plus two gathered
    blocks) at ZeRO-3, nothing on the accelerator when ZeRO-3 offloads it."""
    if not loaded:
        return 0
    if zero_stage < 3:
        return b * p
    return 2 * b * shape.largest_block if offloaded else b * p // n + 2 * b * shape.largest_block
