"""One rank of ``test_learner_reshard``: train the tiny model on fixed batches, optionally resuming from a
checkpoint written by a different data-parallel world size, and optionally checkpointing at one step.

    RANK=r WORLD_SIZE=w LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=p [TORCHELASTIC_USE_AGENT_STORE=True] \\
    python -m tests.integration.reshard_proc MODEL ROOT OUT STEPS [--save-at K] [--resume CKPT]
        [--zero-stage 2] [--dtype fp32] [--sabotage-optimizer] [--batch-split replicate|shard]

(The test starts the ranks against a rendezvous store it holds itself: ``tests.rendezvous``.)

Every rank is fed the whole batch of step ``s`` (``_table(seed=s)``, 6 rows); with ``--batch-split replicate``
(the default here) each rank trains on all of it, with ``shard`` on its own rows (``LearnerConfig.batch_split``).
The last step's metrics go to ``OUT.metrics.json``. Rank 0 writes the final fp32 parameters to ``OUT`` (safetensors) and ``OUT.json``
(``{"step", "version", "world_size"}``). ``--sabotage-optimizer`` drops the AdamW moments after the
resume (ZeRO-1/2 only), so the test can show its comparison would notice a reshard that loses them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from gyre.learner.batch import build_train_batch
from gyre.learner.checkpoint.request import CheckpointRequest
from gyre.learner.config import AlgorithmConfig, LearnerConfig
from gyre.learner.engine import LearnerEngine
from tests.integration.test_learner_engine import _table

ALGO = AlgorithmConfig()
FINGERPRINT = "fixed-batches"


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("model", "root", "out"):
        p.add_argument(name)
    p.add_argument("steps", type=int)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--resume", default="")
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--sabotage-optimizer", action="store_true")
    p.add_argument("--batch-split", default="replicate", choices=("replicate", "shard"))
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = LearnerConfig(model=args.model, zero_stage=args.zero_stage, dtype=args.dtype, micro_batch_size=2,
                        lr=1e-3, seed=7, batch_split=args.batch_split)
    engine = LearnerEngine(cfg, ALGO)
    if args.resume:
        engine.load_checkpoint(Path(args.resume), fingerprint=FINGERPRINT)
        if args.sabotage_optimizer:
            engine.engine.optimizer.optimizer.state.clear()
    metrics = {}
    while engine.step < args.steps:
        metrics = engine.train_step(build_train_batch(_table(seed=engine.step), 0, engine.version, ALGO))
        if engine.step == args.save_at:
            engine.save_checkpoint(CheckpointRequest(args.root, fingerprint=FINGERPRINT))
    weights = {n: t.contiguous() for n, t in engine.named_weights(dtype=torch.float32)}
    if dist.get_rank() == 0:
        save_file(weights, args.out)
        doc = {"step": engine.step, "version": engine.version, "world_size": dist.get_world_size()}
        Path(f"{args.out}.json").write_text(json.dumps(doc))
        Path(f"{args.out}.metrics.json").write_text(json.dumps(metrics))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
