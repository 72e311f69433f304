"""One rank of ``test_learner_split_invariance``: one update of the tiny model per way of splitting the batch.

    RANK=r WORLD_SIZE=w LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.integration.split_grad_proc \\
        MODEL OUT

For each ``loss_agg_mode`` in ``MODES`` and each split in ``SPLITS`` (``micro_batch_size`` 1, 3, all rows; three
``micro_batch_tokens`` budgets) a fresh engine takes one step on the same 6-row batch (sharded over the
ranks), ZeRO-2 fp32, with ``adam_eps = 1`` and ``lr = 1``: AdamW's first step is then ``g / (|g| + 1) ~ g`` (gradients ~1e-4),
so the weight delta is the update's gradient, scale included (plain Adam's ``sign(g)`` would hide a wrong
normaliser). Rank 0 writes every delta to ``OUT`` (safetensors, ``{mode}/{split}/{param}``) and the metrics to
``OUT.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from gyre.learner.batch import build_train_batch
from gyre.learner.config import AlgorithmConfig, LearnerConfig
from gyre.learner.engine import LearnerEngine
from tests.integration.test_learner_engine import _table

MODES = ("token-mean", "seq-mean-token-mean")
SPLITS = {"rows-1": {"micro_batch_size": 1}, "rows-3": {"micro_batch_size": 3}, "rows-all": {"micro_batch_size": 6},
          "tokens-13": {"micro_batch_tokens": 13}, "tokens-25": {"micro_batch_tokens": 25},
          "tokens-63": {"micro_batch_tokens": 63}}
"""The batch's rows hold 8..13 tokens (63 in all): 13 is one row per micro-batch at most, 63 all of them."""


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    deltas, metrics = {}, {}
    for mode in MODES:
        algo = AlgorithmConfig(loss_agg_mode=mode, kl_coef=0.05, entropy_coef=0.01)
        batch = build_train_batch(_table(num_groups=2, group_size=3, seed=4), 0, 0, algo)
        for name, split in SPLITS.items():
            cfg = LearnerConfig(model=model, zero_stage=2, dtype="fp32", lr=1.0, adam_eps=1.0, seed=7, **split)
            engine = LearnerEngine(cfg, algo)
            initial = dict(engine.named_weights(dtype=None))
            metrics[f"{mode}/{name}"] = engine.train_step(batch)
            for param, tensor in engine.named_weights(dtype=None):
                deltas[f"{mode}/{name}/{param}"] = (tensor - initial[param]).contiguous()
    # three rows of 8, 10 and 12 tokens under a 13-token budget: on two ranks one rank holds the 12-token row
    # alone and runs its second micro-batch empty (zero weight), so both ranks make the same collectives
    algo = AlgorithmConfig()
    batch = build_train_batch(_table(num_groups=1, group_size=3, seed=5), 0, 0, algo)
    cfg = LearnerConfig(model=model, zero_stage=2, dtype="fp32", lr=1.0, adam_eps=1.0, seed=7, micro_batch_tokens=13)
    engine = LearnerEngine(cfg, algo)
    initial = dict(engine.named_weights(dtype=None))
    metrics["uneven/tokens-13"] = engine.train_step(batch)
    for param, tensor in engine.named_weights(dtype=None):
        deltas[f"uneven/tokens-13/{param}"] = (tensor - initial[param]).contiguous()
    if dist.get_rank() == 0:
        save_file(deltas, out)
        Path(f"{out}.json").write_text(json.dumps(metrics))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
