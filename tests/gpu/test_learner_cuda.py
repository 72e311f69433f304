"""LearnerEngine training on a real CUDA GPU (skipped without one; CI has none).

A random Llama-shaped model (hidden 512, 8 layers, vocab 32000: ~41 M parameters, built at test time, never
downloaded) trains for a few GRPO steps under real DeepSpeed on one GPU (a world-size-1 NCCL group from
``learner.ds_setup.ensure_distributed``): ZeRO-3 + bf16 + gradient checkpointing, and ZeRO-2 + bf16 without it.
Checks behaviour: every loss finite, every grad norm > 0, the published weights move, the engine is on CUDA.
Prints one JSON line per config (step time, tokens/s, peak CUDA memory, versions, GPU); with
``GYRE_GPU_RESULTS=<file>`` also appends it there.

``GYRE_GPU_TEST_ON_CPU=1`` runs it on CPU instead (gloo, a tiny model), to check the harness on a machine
without a GPU; ``GYRE_GPU_TEST_SIZE=cpu|gpu`` picks the model and batch size either way.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

ON_CPU = os.environ.get("GYRE_GPU_TEST_ON_CPU") == "1"
pytestmark = pytest.mark.skipif(not (ON_CPU or torch.cuda.is_available()),
                                reason="needs a CUDA GPU (GYRE_GPU_TEST_ON_CPU=1 runs it on CPU)")

SIZES = {
    # ~41 M parameters (tied embedding); 64 rows of up to 64 + 320 tokens per step, micro-batches of 16.
    "gpu": dict(vocab=32000, hidden=512, inter=1408, layers=8, heads=8, kv_heads=4, groups=8, group_size=8,
                prompt=(32, 64), response=(64, 320), micro=16),
    # The harness on CPU: the tiny_model shape, 12 short rows.
    "cpu": dict(vocab=1024, hidden=64, inter=128, layers=2, heads=2, kv_heads=1, groups=3, group_size=4,
                prompt=(4, 8), response=(3, 12), micro=4),
}
SIZE = os.environ.get("GYRE_GPU_TEST_SIZE") or ("cpu" if ON_CPU or not torch.cuda.is_available() else "gpu")
SHAPE = SIZES[SIZE]
STEPS = int(os.environ.get("GYRE_GPU_TEST_STEPS", "5"))
CONFIGS = [
    pytest.param(3, True, id="zero3-bf16-ckpt"),
    pytest.param(2, False, id="zero2-bf16"),
]
PAD, BOS, EOS = 0, 1, 2


def _write_tokenizer(out_dir: Path, vocab: int) -> None:
    """A word-level tokenizer of ``vocab`` tokens (``<pad> <s> </s> <unk> t4 t5 ...``), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"t{i}" for i in range(4, vocab)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(out_dir)


def build_llama(out_dir: Path, shape: dict, seed: int = 0) -> Path:
    """Write a random bf16 Llama of ``shape`` (safetensors + config) and a matching tokenizer to ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    _write_tokenizer(out_dir, shape["vocab"])
    return out_dir


def _batch(shape: dict, seed: int, learner_version: int, algo):
    """Whole GRPO groups of random tokens; rewards alternate within each group, so every advantage is != 0."""
    from gyre.learner.batch import build_train_batch
    from gyre.proto.trajectory import Trajectory, make_ids, to_table

    gen = torch.Generator().manual_seed(seed)
    vocab, rows = shape["vocab"], []
    for g in range(shape["groups"]):
        prompt = torch.randint(3, vocab, (int(torch.randint(*shape["prompt"], (1,), generator=gen)),),
                               generator=gen).tolist()
        for s in range(shape["group_size"]):
            length = int(torch.randint(*shape["response"], (1,), generator=gen))
            response = torch.randint(3, vocab, (length,), generator=gen).tolist()
            tid, gid = make_ids(g, s, 0)
            rows.append(Trajectory(
                trajectory_id=tid, group_id=gid, prompt_index=g, sample_index=s, attempt=0, task="t",
                prompt_token_ids=prompt, response_token_ids=response,
                # random tokens under a random model: logprob ~ -ln(vocab)
                behaviour_logprobs=(-math.log(vocab) + 0.3 * torch.randn(length, generator=gen)).tolist(),
                reward=float((s + g) % 2), finish_reason="stop", version_span_starts=[0],
                version_span_versions=[max(learner_version - 1, 0)], reward_fn_version="v", rollout_id="r",
                created_at=0.0,
            ))
    batch = build_train_batch(to_table(rows), PAD, learner_version, algo)
    assert bool((batch.advantages != 0).all()), "every row should carry a non-zero GRPO advantage"
    return batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_llama(tmp_path_factory.mktemp(f"llama-{SIZE}"), SHAPE)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _publish_in_background(engine) -> tuple[dict[str, bytes], float]:
    """Publish the engine's weights as a learner step does (``capture_weights`` on the device, then
    ``BackgroundPublisher``); returns the served bytes per tensor and the seconds the capture blocked."""
    from gyre.learner.background_publish import BackgroundPublisher
    from gyre.learner.publisher import WeightPublisher
    from gyre.learner.versions import StreamedPublishing

    publisher = WeightPublisher()
    background = BackgroundPublisher(publisher, StreamedPublishing())
    _sync()
    t0 = time.perf_counter()
    captured = engine.capture_weights()
    background.submit(1, 0, captured)
    blocking = time.perf_counter() - t0
    assert all(t.device.type == engine.device.type for _, t in captured)
    background.flush(120)
    background.close()
    return {t.name: bytes(t.data) for t in publisher.wait_newer(-1, 0)[1]}, blocking


@pytest.mark.parametrize(("zero_stage", "checkpointing"), CONFIGS)
def test_learner_trains_on_cuda(model_dir, zero_stage, checkpointing):
    import deepspeed
    import transformers

    from gyre.learner.config import AlgorithmConfig, LearnerConfig
    from gyre.learner.engine import LearnerEngine

    algo = AlgorithmConfig()
    cfg = LearnerConfig(model=str(model_dir), zero_stage=zero_stage, dtype="bf16", micro_batch_size=SHAPE["micro"],
                        lr=1e-3, gradient_checkpointing=checkpointing)
    _free()
    mem_before = torch.cuda.memory_allocated() if torch.cuda.is_available() and not ON_CPU else None
    start = time.perf_counter()
    engine = LearnerEngine(cfg, algo)
    init_s = time.perf_counter() - start
    try:
        assert engine.device.type == ("cpu" if ON_CPU else "cuda")
        assert next(engine.module.parameters()).device.type == engine.device.type
        initial = dict(engine.named_weights())
        metrics, wall = [], []
        for i in range(STEPS):
            batch = _batch(SHAPE, seed=100 * zero_stage + i, learner_version=engine.version, algo=algo)
            _sync()
            t0 = time.perf_counter()
            metrics.append(engine.train_step(batch))
            _sync()
            wall.append(time.perf_counter() - t0)
        after = dict(engine.named_weights())
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and not ON_CPU else None
        published, publish_blocking_s = _publish_in_background(engine)
    finally:
        engine.engine.destroy()  # ZeRO-3's hooks and buffers; the next config starts from a clean GPU
        del engine
        _free()

    timed = range(1, STEPS) if STEPS > 1 else range(STEPS)  # the first step warms up kernels and the allocator
    tokens = sum(metrics[i]["tokens"] for i in timed)
    result = {
        "test": "learner_cuda", "config": f"zero{zero_stage}-bf16" + ("-ckpt" if checkpointing else ""),
        "zero_stage": zero_stage, "dtype": cfg.dtype, "gradient_checkpointing": checkpointing, "size": SIZE,
        "params_m": round(sum(t.numel() for t in initial.values()) / 1e6, 1),
        "rows": SHAPE["groups"] * SHAPE["group_size"], "micro_batch": SHAPE["micro"],
        "tokens_per_step": round(tokens / len(timed)), "steps": STEPS,
        "init_s": round(init_s, 2), "first_step_s": round(wall[0], 3),
        "median_step_s": round(statistics.median(wall[i] for i in timed), 4),
        "tokens_per_s": round(tokens / sum(wall[i] for i in timed), 1),
        "optimizer_step_s": round(statistics.median(metrics[i]["optimizer_step_s"] for i in timed), 4),
        "comm_s": round(statistics.median(metrics[i]["comm_s"] for i in timed), 4),
        "peak_cuda_mem_gib": None if peak is None else round(peak / 2**30, 3),
        "publish_blocking_s": round(publish_blocking_s, 4),
        "cuda_mem_before_gib": None if mem_before is None else round(mem_before / 2**30, 3),
        "loss": [round(m["loss"], 5) for m in metrics], "grad_norm": [round(m["grad_norm"], 4) for m in metrics],
        "device": "cpu" if ON_CPU else torch.cuda.get_device_name(0),
        "torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
    }
    line = json.dumps(result)
    print(line)
    if os.environ.get("GYRE_GPU_RESULTS"):
        with open(os.environ["GYRE_GPU_RESULTS"], "a") as f:
            f.write(line + "\n")

    for m in metrics:
        assert math.isfinite(m["loss"]), result
        assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0, result
        assert m["advantage_abs_mean"] > 0, result
    # what the background publish served (device capture, pinned host copy on a side stream) is the trained weights
    assert published == {n: t.reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in after.items()}
    changed = [n for n in initial if not torch.equal(initial[n], after[n])]
    assert len(changed) > len(initial) // 2, f"only {len(changed)}/{len(initial)} tensors changed: {changed}"
