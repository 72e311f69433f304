"""The GPU-shaped learner bench's parts: model shapes built from their config (random weights, nothing
downloaded), GRPO length distributions, the same-process bare DeepSpeed baseline with length-sorted token-budget
micro-batches, and the device's peak. ``python -m bench.learner --shape ... --lengths ...`` uses them.

MFU = 6 × parameters × real tokens / step seconds / the device's bf16 dense peak (the usual training FLOP count:
forward 2N, backward 4N per token; attention's quadratic term left out, as in PaLM's "MFU" without it).
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch

SHAPES = {
    # Qwen2.5-1.5B's config.json (architecture only): 1.54 B parameters, tied embeddings
    "qwen2.5-1.5b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
                     "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                     "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151643},
    # the same family scaled down for 2 CPU cores (the --quick mode in the test suite)
    "qwen2-tiny": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128,
                   "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "vocab_size": 8192, "max_position_embeddings": 4096,
                   "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                   "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1},
}

LENGTHS = {
    # issue #41's math rollouts: 16 prompts x 8 samples, prompts 64-320 tokens, responses 32-1536 with a heavy tail
    "grpo-math": {"prompts": 16, "group_size": 8, "prompt": (64, 320), "response": (32, 1536), "median": 200},
    # the same shape at 1/8 of the lengths and a quarter of the rows (CPU quick mode)
    "grpo-math-small": {"prompts": 4, "group_size": 8, "prompt": (8, 40), "response": (4, 192), "median": 25},
}

PEAK_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0}
"""bf16 dense tensor-core peak (TFLOP/s) by device name fragment (NVIDIA's datasheets, SXM parts)."""


def build_model(shape: str, out: Path, dtype: torch.dtype) -> Path:
    """A random-weight model of ``shape`` written as an HF folder at ``out`` (safetensors, config); returns
    ``out``. Seeded (torch 0): the same weights every run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").is_file():
        return out
    cfg = dict(SHAPES[shape])
    config = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    return out


def parameter_count(shape: str) -> int:
    """Parameters of ``shape`` (tied embeddings counted once), from a meta-device build."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(SHAPES[shape])
    config = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def sample_lengths(name: str, seed: int = 0) -> list[tuple[int, int]]:
    """``(prompt, response)`` token counts per row, groups contiguous (a group shares its prompt). Responses are
    log-normal around the median (sigma 1), clipped to the range: most short, a heavy tail at the budget."""
    spec = LENGTHS[name]
    rng = random.Random(seed)
    rows = []
    for _ in range(spec["prompts"]):
        prompt = rng.randint(*spec["prompt"])
        for _ in range(spec["group_size"]):
            response = int(math.exp(rng.gauss(math.log(spec["median"]), 1.0)))
            rows.append((prompt, min(max(response, spec["response"][0]), spec["response"][1])))
    return rows


def make_length_table(lengths: list[tuple[int, int]], group_size: int, vocab: int, seed: int = 0):
    """A trajectory table of random tokens with the given lengths, GRPO groups of ``group_size``."""
    from gyre.proto.trajectory import Trajectory, make_ids, to_table

    gen = torch.Generator().manual_seed(seed)
    rows, prompt = [], []
    for i, (p_len, r_len) in enumerate(lengths):
        g, s = divmod(i, group_size)
        if s == 0:
            prompt = torch.randint(2, vocab, (p_len,), generator=gen).tolist()
        tid, gid = make_ids(g, s, 0)
        rows.append(Trajectory(
            trajectory_id=tid, group_id=gid, prompt_index=g, sample_index=s, attempt=0, task="bench",
            prompt_token_ids=prompt, response_token_ids=torch.randint(2, vocab, (r_len,), generator=gen).tolist(),
            behaviour_logprobs=(-math.log(vocab) + 0.1 * torch.randn(r_len, generator=gen)).tolist(),
            reward=float((g + s) % 2), finish_reason="stop", version_span_starts=[0], version_span_versions=[0],
            reward_fn_version="bench", rollout_id="bench", created_at=0.0))
    return to_table(rows)


def sorted_budget_micro_batches(lengths: torch.Tensor, budget: int) -> list[list[int]]:
    """The baseline's micro-batches: rows sorted by length, consecutive rows grouped while ``rows x longest``
    (the padded tensor) stays within ``budget`` tokens."""
    order = sorted(range(len(lengths)), key=lambda r: -int(lengths[r]))
    out, cur = [], []
    for r in order:
        if cur and (len(cur) + 1) * int(lengths[cur[0]]) > budget:
            out.append(cur)
            cur = []
        cur.append(r)
    return out + ([cur] if cur else [])


def bare_sorted_step(ds_engine, batch, budget: int) -> tuple[float, float]:
    """The baseline step: length-sorted, padded token-budget micro-batches, HF forward with an attention mask and
    full logits, a plain policy-gradient loss on the response tokens, backward, ``engine.step()``. Returns
    ``(seconds, pad fraction of the tokens it computed)``."""
    from gyre.learner.algo.logprobs import token_logprobs

    _sync()
    t0 = time.perf_counter()
    ds_engine.train()
    lengths = batch.attention_mask.sum(dim=1)
    normaliser = float(max(batch.num_response_tokens, 1))
    computed = 0
    for rows in sorted_budget_micro_batches(lengths, budget):
        idx = torch.tensor(rows)
        width = int(lengths[idx].max())
        computed += width * len(rows)
        device = ds_engine.device
        ids = batch.input_ids[idx, :width].to(device)
        logits = ds_engine(input_ids=ids, attention_mask=batch.attention_mask[idx, :width].to(device)).logits
        logprobs = token_logprobs(logits, ids)
        resp = batch.response_mask[idx, : width - 1].to(device)
        adv = batch.advantages[idx].to(device).unsqueeze(1)
        loss = -(logprobs * adv)[resp].sum() / normaliser
        ds_engine.backward(loss, scale_wrt_gas=False)
    ds_engine.step()
    _sync()
    return time.perf_counter() - t0, 1.0 - float(lengths.sum()) / computed


def bare_engine(config):
    """A DeepSpeed engine with the learner's DeepSpeed config and the stock (SDPA, padded) model."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    from gyre.learner.ds_setup import _DTYPES, build_ds_config

    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=_DTYPES[config.dtype], attn_implementation="sdpa")
    model.config.use_cache = False
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ds = build_ds_config(config)
    ds.pop("comms_logger", None)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    return engine


def device_peak() -> tuple[str, float]:
    """``(name, bf16 dense TFLOP/s)``: a datasheet peak for a known GPU; on a CPU (or an unknown GPU) the
    measured throughput of a large bf16 matmul, named as measured."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        for key, tflops in PEAK_TFLOPS.items():
            if key in name:
                return f"{name} (datasheet bf16 dense)", tflops
    n = 2048 if torch.cuda.is_available() else 1024
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    a @ b
    _sync()
    reps, t0 = 5, time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync()
    tflops = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12
    return f"{dev} measured {n}x{n} bf16 matmul", tflops


def peak_memory_gib() -> float:
    """Peak accelerator memory allocated (GiB), or on a CPU the process's peak resident set (GiB)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
