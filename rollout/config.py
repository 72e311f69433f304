"""Configuration of the rollout engine (the vLLM wrapper in ``rollout/engine.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class EngineConfig(BaseModel):
    """How to start one vLLM engine that serves one policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    """Path of a local HF model folder: ``config.json``, ``*.safetensors`` and the tokenizer.
    Hub ids are not accepted (gyre never downloads at run time)."""

    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the weights and activations inside vLLM. Weight updates are cast to it."""

    max_model_len: int = Field(default=1024, ge=1)
    """Longest prompt + response, in tokens, that one request may reach."""

    kv_cache_gib: float = Field(default=1.0, gt=0)
    """KV-cache memory in GiB, passed to vLLM as ``kv_cache_memory_bytes`` (fractional GiB work).
    On CPU the legacy env var ``VLLM_CPU_KVCACHE_SPACE`` (integer GiB), when set, overrides it."""

    max_num_seqs: int = Field(default=64, ge=1)
    """Most sequences vLLM runs in one batch (a group of ``n`` samples counts ``n``)."""

    enforce_eager: bool = True
    """Skip torch.compile and CUDA graphs: much faster start, slower steps on GPU."""

    seed: int = 0
    """Engine-level seed; a request without its own seed samples from this stream."""

    @field_validator("model")
    @classmethod
    def _model_is_local_folder(cls, value: str) -> str:
        folder = Path(value)
        if not (folder / "config.json").is_file():
            raise ValueError(f"model ({value!r}) must be a local HF folder containing config.json")
        if not any(folder.glob("*.safetensors")):
            raise ValueError(f"model ({value!r}) contains no *.safetensors file")
        return value


class SamplingConfig(BaseModel):
    """How to sample one group of responses."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0)
    """Softmax temperature; 0 means greedy. Behaviour logprobs are taken after it is applied."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus-sampling mass; 1.0 disables it."""

    max_new_tokens: int = Field(default=64, ge=1)
    """Most response tokens per sample; a sample that reaches it ends with ``"length"``."""

    ignore_eos: bool = False
    """Keep sampling past EOS until ``max_new_tokens`` (benchmarks and tests only)."""
