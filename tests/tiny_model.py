"""A tiny randomly initialised Llama with SmolLM2's tokenizer, built at test time (never downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_DIR = Path(os.environ.get("GYRE_SMOLLM2_DIR", REPO / ".cache/models/SmolLM2-135M-Instruct"))


def build_tiny_llama(out_dir: Path, seed: int = 0) -> Path:
    """Write a 2-layer, 64-wide (2 heads × 32) Llama (bf16 safetensors) plus SmolLM2's tokenizer to ``out_dir``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # vLLM-CPU attention supports head sizes 32, 64, 80, ... (not 16)
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


def build_tiny_classifier(out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny random ``LlamaForSequenceClassification`` reward model (one label, the tiny Llama's shape,
    float32 safetensors) plus SmolLM2's tokenizer to ``out_dir``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                         num_labels=1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir
