"""Rollout benchmark: ``python -m bench.rollout [--quick] [--weight-sync-only]``. The last line printed is
one JSON object (``--weight-sync-only``: just the ``weight_sync_*`` keys, no vLLM engine started).

Baselines are measured in the same run, on the same machine:

- ``rollout_overhead_ratio``: tokens/s of gyre's ``RolloutEngine.generate`` (groups of ``n``, behaviour
  logprobs, version spans, ``Sample`` conversion) with the service's weight subscriber attached (idle) ÷
  bare vLLM ``AsyncLLM.generate`` of the same prompts, ``n``, lengths and sampling settings, also asking
  for the sampled tokens' logprobs, on the same engine; rounds alternate which goes first; median of the
  per-round ratios.
- ``weight_sync_ratio``: GB/s of one version delivered to 2 ``WeightSubscriber``s (staged, CRC-32C
  verified, assembled into tensors), each in its own process as rollout services are, from a WeightService
  subprocess ÷ 2 client processes draining a raw grpcio byte stream of the same bytes in the same message
  size from a subprocess with the same server options (timed from a common ``go`` after every process
  started; rounds alternate which goes first; median of the per-round ratios).
- ``smollm2_sync_apply_s``: SmolLM2-135M, seconds from ``publish`` (encode included) on an in-process
  WeightService to the engine reporting the new version (gRPC transfer, verify, /dev/shm safetensors,
  vLLM load, cache reset), median over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.rollout_parts import (WeightFeed, WeightServerProc, bare_vllm_tokens, fetch_main, gyre_tokens,
                                 process_fetch_s, serve_weights)

SMOLLM2 = Path(__file__).resolve().parents[1] / ".cache/models/SmolLM2-135M-Instruct"


def weight_sync(total_bytes: int, rounds: int) -> dict:
    """GB/s of one version to 2 gyre subscribers ÷ 2 raw-stream clients. Each round measures both back to
    back (which goes first alternates); ``weight_sync_ratio`` is the median of the per-round ratios, so load
    drifting between rounds hits both halves of a pair alike (the ratio of medians is reported beside it)."""
    gyre_s, raw_s, nbytes = [], [], 0

    def gyre() -> None:
        server = WeightServerProc("gyre", total_bytes)
        try:
            gyre_s.append(process_fetch_s("gyre", server.address, 2)[0])
        finally:
            server.stop()

    def raw() -> None:
        nonlocal nbytes
        server = WeightServerProc("raw", total_bytes)
        try:
            seconds, nbytes = process_fetch_s("raw", server.address, 2)
            raw_s.append(seconds)
        finally:
            server.stop()

    for r in range(rounds):
        for run in (gyre, raw) if r % 2 == 0 else (raw, gyre):
            run()
    ratios = sorted(r / g for g, r in zip(gyre_s, raw_s))  # seconds raw ÷ gyre = gyre GB/s ÷ raw GB/s, per round
    gyre_gb_s = 2 * nbytes / statistics.median(gyre_s) / 1e9
    raw_gb_s = 2 * nbytes / statistics.median(raw_s) / 1e9
    return {"weight_sync_ratio": round(statistics.median(ratios), 3),
            "weight_sync_ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
            "weight_sync_ratio_of_medians": round(gyre_gb_s / raw_gb_s, 3), "weight_sync_rounds": rounds,
            "weight_sync_gb_s": round(gyre_gb_s, 3), "raw_stream_gb_s": round(raw_gb_s, 3),
            "weight_sync_bytes": nbytes}


async def generation(engine, prompts, n: int, max_tokens: int, rounds: int) -> dict:
    """tok/s of ``RolloutEngine.generate`` and of bare ``AsyncLLM.generate`` on the same engine and load.

    Each round runs both back to back (which goes first alternates). ``rollout_overhead_ratio`` is the
    median of the per-round ratios: load from other processes that drifts between rounds (a shared
    machine) hits both halves of a pair alike. The ratio of the two medians is reported beside it.
    """
    await gyre_tokens(engine, prompts[:2], n, 4)  # warm up both paths
    await bare_vllm_tokens(engine._llm, prompts[:2], n, 4)
    gyre, bare = [], []
    runs = [(bare, lambda: bare_vllm_tokens(engine._llm, prompts, n, max_tokens)),
            (gyre, lambda: gyre_tokens(engine, prompts, n, max_tokens))]
    for r in range(rounds):
        for rates, run in runs if r % 2 == 0 else runs[::-1]:  # alternate which goes first
            t0 = time.perf_counter()
            tokens = await run()
            rates.append(tokens / (time.perf_counter() - t0))
    ratios = sorted(g / b for g, b in zip(gyre, bare))
    g, b = statistics.median(gyre), statistics.median(bare)
    return {"rollout_overhead_ratio": round(statistics.median(ratios), 3),
            "rollout_overhead_ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
            "rollout_overhead_ratio_of_medians": round(g / b, 3), "generation_rounds": rounds,
            "gyre_tok_s": round(g, 1), "bare_vllm_tok_s": round(b, 1)}


async def sync_apply(feed: WeightFeed, rounds: int) -> dict:
    """SmolLM2 versions published on ``feed``: seconds until the engine reports each (median)."""
    from gyre.proto.exports import load_export

    base, engine = load_export(SMOLLM2), feed.engine
    times, delivered = [], []
    for i in range(rounds):
        version = engine.version + 1
        named = [(n, t * (1.0 + 1e-3 * (i + 1))) for n, t in base]
        t0 = time.perf_counter()
        feed.publisher.publish(version, named)
        while engine.version < version:
            await asyncio.sleep(0.005)
        times.append(time.perf_counter() - t0)
        delivered.append(feed.arrived[-1] - t0)
    nbytes = sum(t.numel() * t.element_size() for _, t in base)
    return {"smollm2_sync_apply_s": round(statistics.median(times), 3), "smollm2_bytes": nbytes,
            "smollm2_publish_to_verified_s": round(statistics.median(delivered), 3),
            "smollm2_engine_apply_s": round(statistics.median(feed.applied_s), 3)}


async def engine_part(quick: bool) -> dict:
    from gyre.rollout.config import EngineConfig
    from gyre.rollout.engine import RolloutEngine

    engine = await RolloutEngine.start(EngineConfig(model=str(SMOLLM2), kv_cache_gib=1.0, max_model_len=512,
                                                    max_num_seqs=64), initial_version=0)
    feed = WeightFeed(engine, asyncio.get_running_loop())  # the service's weight subscriber, attached throughout
    try:
        prompts = [[1 + (7 * i + j) % 4000 for j in range(32)] for i in range(8)]
        out = await generation(engine, prompts, n=4, max_tokens=32 if quick else 96, rounds=10 if quick else 16)
        out.update(await sync_apply(feed, rounds=3 if quick else 7))
        return out
    finally:
        feed.stop()
        await engine.shutdown()
        del engine, feed
        gc.collect()  # vLLM's AsyncLLM.__del__ fails if it first runs at interpreter exit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--weight-sync-only", action="store_true",
                        help="measure only weight_sync_ratio (no vLLM engine)")
    parser.add_argument("--weights-server", nargs=3, metavar=("KIND", "PORT_FILE", "BYTES"), help=argparse.SUPPRESS)
    parser.add_argument("--fetch", nargs=2, metavar=("KIND", "ADDRESS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fetch:
        fetch_main(*args.fetch)
        return
    if args.weights_server:
        kind, bound, nbytes = args.weights_server
        serve_weights(kind, bound, int(nbytes))
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = {"quick": args.quick}
    result.update(weight_sync(270 << 20, rounds=7 if args.quick else 11))
    if args.weight_sync_only:
        print(json.dumps(result))
        return
    print(json.dumps(result), file=sys.stderr)
    result.update(asyncio.run(engine_part(args.quick)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
