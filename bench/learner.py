"""Learner benchmark: ``python -m bench.learner [--quick] [--model DIR]``. The last line printed is one JSON object.

Both ratios compare against a baseline measured in the same process, on the same batch, interleaved so
that machine noise hits both sides alike (medians of the repetitions):

- ``step_overhead_ratio``: ``LearnerEngine.train_step`` (GRPO batch → decoupled PPO + TIS loss, metrics,
  comm timing) ÷ a bare DeepSpeed step on the same batch: the same DeepSpeed config and micro-batches,
  forward, a plain policy-gradient loss on the response tokens, backward, ``engine.step()``. Goal ≤ 1.10.
- ``async_save_overhead_ratio``: a learner step while an async checkpoint (``learner.async_save``) is being
  written ÷ a learner step with no save in flight. Goal ≤ 1.15. Also reported: the time training is
  blocked by the async save (``async_save_blocking_s``: the in-memory capture) and by a synchronous
  save of the same state (``sync_save_s``), and the checkpoint size.

Default model: SmolLM2-135M-Instruct (``make model``), bf16, ZeRO-2, CPU/gloo.

With ``--shape SHAPE --lengths DIST`` (``bench.learner_shapes``) it is the GPU-shaped bench instead: a random model
of ``SHAPE``'s architecture (built from its config, nothing downloaded), a GRPO batch drawn from ``DIST`` (seeded),
``LearnerEngine.train_step`` with packed token-budget micro-batches (``--budget`` tokens per micro-batch) against
a same-process bare DeepSpeed step on length-sorted, padded token-budget micro-batches with full logits
(``sorted_budget_ratio`` = gyre ÷ bare; goal <= 0.7 on a GPU), plus tokens/s, MFU against the device's bf16 dense
peak (named; on a CPU a measured matmul rate), pad fractions and peak memory, and the publish of a version:
``publish_blocking_s`` (what a step waits for: the device capture; goal <= 0.5 s for 1.5B on an H200) against
``publish_inline_s`` (host copy + CRC-32C inside the step, as before), ``publish_ratio`` = the two's ratio and
``publish_background_s`` (what now runs behind the next steps). ``python -m bench.learner --shape
qwen2.5-1.5b --lengths grpo-math`` on an H100/H200; ``--shape qwen2-tiny --lengths grpo-math-small --quick`` on
CPU (the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / ".cache/models/SmolLM2-135M-Instruct"


def make_table(groups: int, group_size: int, prompt_len: int, response_len: int, seed: int = 0):
    """Whole GRPO groups of random tokens with plausible behaviour logprobs and 0/1 rewards."""
    from gyre.proto.trajectory import Trajectory, make_ids, to_table

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for g in range(groups):
        prompt = torch.randint(1, 49000, (prompt_len,), generator=gen).tolist()
        for s in range(group_size):
            response = torch.randint(1, 49000, (response_len,), generator=gen).tolist()
            tid, gid = make_ids(g, s, 0)
            rows.append(Trajectory(
                trajectory_id=tid, group_id=gid, prompt_index=g, sample_index=s, attempt=0, task="bench",
                prompt_token_ids=prompt, response_token_ids=response,
                behaviour_logprobs=(-10.0 + torch.randn(response_len, generator=gen)).tolist(),
                reward=float((g + s) % 2), finish_reason="stop", version_span_starts=[0],
                version_span_versions=[0], reward_fn_version="bench", rollout_id="bench", created_at=0.0))
    return to_table(rows)


def bare_step(ds_engine, batch, micro_batch_size: int) -> float:
    """The baseline: forward, plain REINFORCE loss on response tokens, backward, step; returns seconds."""
    from gyre.learner.algo.logprobs import token_logprobs

    t0 = time.perf_counter()
    ds_engine.train()
    normaliser = float(max(batch.num_response_tokens, 1))
    for lo in range(0, batch.batch_size, micro_batch_size):
        rows = slice(lo, lo + micro_batch_size)
        mask = batch.attention_mask[rows]
        length = int(mask.sum(dim=1).max())
        ids = batch.input_ids[rows, :length]
        logits = ds_engine(input_ids=ids, attention_mask=mask[:, :length]).logits
        logprobs = token_logprobs(logits, ids)
        resp = batch.response_mask[rows, : length - 1]
        loss = -(logprobs * batch.advantages[rows].unsqueeze(1))[resp].sum() / normaliser
        ds_engine.backward(loss, scale_wrt_gas=False)
    ds_engine.step()
    return time.perf_counter() - t0


def bare_engine(config):
    """A DeepSpeed engine with exactly the learner's DeepSpeed config, nothing of gyre around it."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    from gyre.learner.ds_setup import _DTYPES, build_ds_config

    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=_DTYPES[config.dtype])
    model.config.use_cache = False
    ds = build_ds_config(config)
    ds.pop("comms_logger", None)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    return engine


def measure_step_overhead(learner, bare, batch, reps: int) -> dict:
    """Interleaved learner / bare steps on the same batch; medians."""
    mine, base = [], []
    learner.train_step(batch)  # warm-up both (allocator, first-touch)
    bare_step(bare, batch, learner.config.rows_per_micro_batch)
    for _ in range(reps):
        t0 = time.perf_counter()
        learner.train_step(batch)
        mine.append(time.perf_counter() - t0)
        base.append(bare_step(bare, batch, learner.config.rows_per_micro_batch))
    return {"learner_step_s": statistics.median(mine), "bare_step_s": statistics.median(base),
            "step_overhead_ratio": statistics.median(mine) / statistics.median(base)}


def steps_while_pending(step: Callable[[], object], future: Future) -> list[float]:
    """Run ``step()`` again and again while ``future`` (an async save) is not done; returns the seconds of
    each step, all of which began with the save in flight (none if it was done already). A step the save
    finishes during counts (it overlapped the write); no step begun after the save finished does."""
    during = []
    while not future.done():
        t0 = time.perf_counter()
        step()
        during.append(time.perf_counter() - t0)
    return during


def measure_async_save(learner, batch, root: Path, rounds: int) -> dict:
    """Steps with no save in flight vs steps begun while an async save writes (``steps_while_pending``);
    plus blocking times. ``async_save_overhead_ratio`` is ``None`` when every save finished before a step
    could begin (``steps_overlapping_save`` 0)."""
    from gyre.learner.checkpoint.async_save import BackgroundSaver
    from gyre.learner.checkpoint.request import CheckpointRequest

    saver = BackgroundSaver()
    idle, during, blocking, write_s = [], [], [], []
    for r in range(rounds):
        for _ in range(2):
            t0 = time.perf_counter()
            learner.train_step(batch)
            idle.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        future = learner.save_checkpoint(CheckpointRequest(root / "async", keep_last_n=1, saver=saver))
        blocking.append(time.perf_counter() - t0)
        during += steps_while_pending(lambda: learner.train_step(batch), future)
        future.result()
        write_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    path = learner.save_checkpoint(CheckpointRequest(root / "sync", keep_last_n=1))
    sync_s = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    saver.shutdown()
    during_s = statistics.median(during) if during else None
    return {"idle_step_s": statistics.median(idle), "step_during_save_s": during_s,
            "steps_overlapping_save": len(during),
            "async_save_overhead_ratio": None if during_s is None else during_s / statistics.median(idle),
            "async_save_blocking_s": statistics.median(blocking), "async_save_total_s": statistics.median(write_s),
            "sync_save_s": sync_s, "checkpoint_bytes": size}


def measure_publish(learner, reps: int) -> dict:
    """Seconds a version's publish blocks the step, gyre's way (``capture_weights`` on the device, synchronised,
    then queued for ``BackgroundPublisher``) against the inline way it replaced (``named_weights`` to host memory,
    then ``encode_tensors``: bytes + CRC-32C), alternating, medians; and how long the background part took."""
    from bench import learner_shapes as shapes
    from gyre.learner.background_publish import BackgroundPublisher
    from gyre.learner.publisher import WeightPublisher
    from gyre.learner.versions import StreamedPublishing
    from gyre.proto.tensor_chunks import encode_tensors

    background = BackgroundPublisher(WeightPublisher(), StreamedPublishing())
    blocking, inline, behind = [], [], []
    for version in range(1, reps + 1):
        shapes._sync()
        t0 = time.perf_counter()
        captured = learner.capture_weights()
        shapes._sync()
        background.submit(version, 0, captured)
        blocking.append(time.perf_counter() - t0)
        background.flush()
        behind.append(background.last_background_s)
        t0 = time.perf_counter()
        encode_tensors(learner.named_weights())
        inline.append(time.perf_counter() - t0)
    background.close()
    return {"publish_blocking_s": statistics.median(blocking), "publish_inline_s": statistics.median(inline),
            "publish_background_s": statistics.median(behind),
            "publish_ratio": statistics.median(blocking) / statistics.median(inline)}


def shape_bench(shape: str, lengths: str, budget: int, zero_stage: int, reps: int, model_root: Path,
                gradient_checkpointing: bool | None = None) -> dict:
    """The GPU-shaped bench (module docstring): one dict of results."""
    from bench import learner_shapes as shapes
    from gyre.learner.batch import build_train_batch
    from gyre.learner.config import AlgorithmConfig, LearnerConfig
    from gyre.learner.engine import LearnerEngine

    cuda = torch.cuda.is_available()
    gc = cuda if gradient_checkpointing is None else gradient_checkpointing
    model_dir = shapes.build_model(shape, model_root / shape, torch.bfloat16)
    config = LearnerConfig(model=str(model_dir), zero_stage=zero_stage, dtype="bf16", micro_batch_tokens=budget,
                           gradient_checkpointing=gc, lr=1e-6)
    rows = shapes.sample_lengths(lengths)
    spec = shapes.LENGTHS[lengths]
    algo = AlgorithmConfig(max_response_tokens=spec["response"][1])
    table = shapes.make_length_table(rows, spec["group_size"], shapes.SHAPES[shape]["vocab_size"])
    batch = build_train_batch(table, 0, 0, algo)
    real = int(batch.attention_mask.sum())
    learner = LearnerEngine(config, algo)
    learner.train_step(batch)  # warm-up, and the learner's peak memory before the baseline engine exists
    memory = shapes.peak_memory_gib()
    bare = shapes.bare_engine(config)
    shapes.bare_sorted_step(bare, batch, budget)  # warm-up
    peak_name, peak_tflops = shapes.device_peak()
    mine, base, pads, metrics = [], [], [], {}
    for _ in range(reps):  # interleaved, so machine noise hits both sides alike
        shapes._sync()
        t0 = time.perf_counter()
        metrics = learner.train_step(batch)
        shapes._sync()
        mine.append(time.perf_counter() - t0)
        seconds, pad = shapes.bare_sorted_step(bare, batch, budget)
        base.append(seconds)
        pads.append(pad)
    step, bare_step = statistics.median(mine), statistics.median(base)
    publish = measure_publish(learner, reps)
    params = shapes.parameter_count(shape)
    lengths_t = batch.attention_mask.sum(dim=1)
    rowcount_padded = sum(8 * int(lengths_t[i:i + 8].max()) for i in range(0, batch.batch_size, 8))
    return {"shape": shape, "lengths": lengths, "parameters": params, "rows": batch.batch_size, "real_tokens": real,
            "micro_batch_tokens": budget, "zero_stage": zero_stage, "gradient_checkpointing": gc,
            "micro_batches": metrics["micro_batches"], "device": peak_name, "device_peak_tflops": peak_tflops,
            "step_s": step, "tokens_per_s": real / step, "mfu": 6 * params * real / step / (peak_tflops * 1e12),
            "pad_fraction": 0.0, "peak_memory_gib": memory, "bare_step_s": bare_step,
            "bare_pad_fraction": statistics.median(pads), "rowcount8_pad_fraction": 1 - real / rowcount_padded,
            "bare_mfu": 6 * params * real / bare_step / (peak_tflops * 1e12),
            "sorted_budget_ratio": step / bare_step, **publish, "reps": reps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (~3 min on 2 CPU cores)")
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir, removed)")
    parser.add_argument("--shape", default=None, help="GPU-shaped bench: qwen2.5-1.5b | qwen2-tiny")
    parser.add_argument("--lengths", default="grpo-math", help="grpo-math | grpo-math-small")
    parser.add_argument("--budget", type=int, default=None,
                        help="micro_batch_tokens of both sides (default 16384; 2048 with --quick)")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--models-dir", default=str(REPO / ".cache/bench-models"),
                        help="where shape models are built (reused)")
    args = parser.parse_args()
    if args.shape:
        budget = args.budget or (2048 if args.quick else 16384)
        result = shape_bench(args.shape, args.lengths, budget, args.zero_stage, 2 if args.quick else 5,
                             Path(args.models_dir))
        print(json.dumps({"quick": args.quick} | {k: round(v, 4) if isinstance(v, float) else v
                                                  for k, v in result.items()}))
        return
    from gyre.learner.batch import build_train_batch
    from gyre.learner.config import AlgorithmConfig, LearnerConfig
    from gyre.learner.engine import LearnerEngine

    torch.manual_seed(0)
    config = LearnerConfig(model=args.model, zero_stage=2, dtype="bf16", micro_batch_size=8, lr=1e-6)
    algo = AlgorithmConfig()
    groups, group_size = (2, 8) if args.quick else (4, 8)
    batch = build_train_batch(make_table(groups, group_size, 48, 32), 0, 0, algo)
    learner = LearnerEngine(config, algo)
    bare = bare_engine(config)
    result = {"model": Path(args.model).name, "batch_sequences": batch.batch_size,
              "tokens_per_batch": int(batch.attention_mask.sum()), "quick": args.quick}
    result |= measure_step_overhead(learner, bare, batch, reps=4 if args.quick else 10)
    del bare
    result |= measure_publish(learner, reps=3 if args.quick else 5)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gyre-bench-learner-"))
    try:
        result |= measure_async_save(learner, batch, root, rounds=2 if args.quick else 4)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    result = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
