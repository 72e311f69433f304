"""The reward-model service's classifier on a real CUDA GPU (skipped without one; CI has none).

A random Llama-shaped sequence classifier (hidden 1024, 8 layers, SmolLM2's vocabulary: ~150 M parameters, built
at test time) is served by the real gRPC ``RewardModelService``; 8 clients (standing for 8 rollouts) send 32
responses each at once. Checks behaviour: every response scored, requests batched, the model on CUDA in bf16,
and each score equal to a float32 CPU forward pass of the same model within bf16's precision. Prints one JSON line
(responses/s, batches, peak CUDA memory, GPU); with ``GYRE_GPU_RESULTS=<file>`` also appends it there.

``GYRE_GPU_TEST_ON_CPU=1`` runs the harness on CPU with the tiny shape (float32 both ways).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
import torch

ON_CPU = os.environ.get("GYRE_GPU_TEST_ON_CPU") == "1"
pytestmark = pytest.mark.skipif(not (ON_CPU or torch.cuda.is_available()),
                                reason="needs a CUDA GPU (GYRE_GPU_TEST_ON_CPU=1 runs it on CPU)")
SHAPE = (dict(hidden=64, inter=128, layers=2, heads=2, kv=1) if ON_CPU or not torch.cuda.is_available()
         else dict(hidden=1024, inter=2816, layers=8, heads=16, kv=4))
CLIENTS, PER_CLIENT = 8, 32


def build_classifier(out):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from tests.tiny_model import SMOLLM2_DIR

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=SHAPE["hidden"], intermediate_size=SHAPE["inter"],
                         num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"],
                         num_key_value_heads=SHAPE["kv"], max_position_embeddings=2048, num_labels=1,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def test_classifier_reward_model_on_cuda(tmp_path):
    from gyre.rollout.rewards.base import RewardConfig
    from gyre.rollout.rewards.model import ScoreItem, model_spec
    from gyre.services.reward_model.host import ClassifierScorer, RewardModelHost
    from gyre.services.reward_model.config import RewardServiceConfig
    from gyre.services.reward_model.server import serve
    from gyre.services.rollout.reward_client import GrpcRewardModels

    folder = build_classifier(tmp_path / "rm")
    spec = model_spec(RewardConfig(model=str(folder)))
    host = RewardModelHost(batch_size=64)
    server, port, batcher = serve(host, RewardServiceConfig(batch_size=64, max_wait_ms=20))
    prompt = [{"role": "user", "content": "What is 17 * 23? Think step by step, then give the final number."}]
    texts = [[f"Client {c}, try {i}: " + " ".join(f"{c * i + k} times" for k in range(40)) for i in range(PER_CLIENT)]
             for c in range(CLIENTS)]
    clients = [GrpcRewardModels(f"127.0.0.1:{port}") for _ in range(CLIENTS)]

    async def all_clients():
        return await asyncio.gather(*(cl.score(spec, [ScoreItem(prompt, t) for t in ts], 300)
                                      for cl, ts in zip(clients, texts)))

    asyncio.run(all_clients())  # warm-up: load the model, CUDA kernels
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    before = dict(batcher.counts)
    t0 = time.perf_counter()
    results = asyncio.run(all_clients())
    seconds = time.perf_counter() - t0
    server.stop(grace=0)

    flat = [r for rs in results for r in rs]
    assert len(flat) == CLIENTS * PER_CLIENT and all(r.error == "" and r.version == spec.version for r in flat)
    batches = batcher.counts["batches"] - before["batches"]
    assert batcher.counts["requests"] - before["requests"] == CLIENTS and batches < CLIENTS
    scorer = host.load(spec)
    assert scorer.device == ("cuda" if torch.cuda.is_available() else "cpu")
    # the same model in float32 on CPU: equal within bf16's precision
    cpu = ClassifierScorer.__new__(ClassifierScorer)
    cpu.params, cpu.batch_size, cpu.device, cpu.tokenizer = scorer.params, 8, "cpu", scorer.tokenizer
    cpu.model = scorer.model.to("cpu", torch.float32) if ON_CPU else \
        type(scorer.model).from_pretrained(folder, dtype=torch.float32).eval()
    reference = cpu.score([ScoreItem(prompt, t) for t in texts[0][:8]])
    got = [r.reward for r in results[0][:8]]
    spread = max(abs(s) for s, _ in reference) or 1.0
    assert all(abs(g - s) <= 0.05 * spread + 0.02 for g, (s, _) in zip(got, reference)), (got, reference)
    row = {"test": "reward_model_cuda", "params_m": round(sum(p.numel() for p in scorer.model.parameters()) / 1e6, 1),
           "responses": len(flat), "clients": CLIENTS, "batches": batches, "seconds": round(seconds, 3),
           "responses_per_s": round(len(flat) / seconds, 1),
           "peak_cuda_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "max_abs_diff_vs_fp32": round(max(abs(g - s) for g, (s, _) in zip(got, reference)), 4)}
    print(json.dumps(row))
    if os.environ.get("GYRE_GPU_RESULTS"):
        with open(os.environ["GYRE_GPU_RESULTS"], "a") as f:
            f.write(json.dumps(row) + "\n")
