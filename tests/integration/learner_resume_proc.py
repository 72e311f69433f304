"""Child process for ``test_learner_resume``: train the tiny model on fixed batches, checkpointing every
step; optionally SIGKILL itself mid-run, or resume from the newest verified checkpoint first.

    python -m tests.integration.learner_resume_proc MODEL ROOT OUT STEPS [--kill-after N] [--resume]
        [--sabotage optimizer|rng] [--async-save]

Writes the final fp32 parameters to OUT (safetensors). ``--sabotage`` deliberately breaks the resume
(drops the optimizer state or re-seeds the RNG after loading) so the test can show it would notice.
``--async-save`` writes every checkpoint in the background (``learner.async_save``) while training goes on.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from safetensors.torch import save_file

from learner import checkpoint as ckpt
from learner.async_save import BackgroundSaver
from learner.batch import build_train_batch
from learner.ckpt_request import CheckpointRequest
from learner.config import AlgorithmConfig, LearnerConfig
from learner.engine import LearnerEngine
from tests.integration.test_learner_engine import _table

ALGO = AlgorithmConfig()


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("model", "root", "out"):
        p.add_argument(name)
    p.add_argument("steps", type=int)
    p.add_argument("--kill-after", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--sabotage", choices=["optimizer", "rng"])
    p.add_argument("--async-save", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = LearnerConfig(model=args.model, zero_stage=2, dtype="fp32", micro_batch_size=2, lr=1e-3, seed=7)
    engine = LearnerEngine(cfg, ALGO)
    if args.resume:
        engine.load_checkpoint(ckpt.resolve_resume("auto", args.root), fingerprint="fixed-batches")
        if args.sabotage == "optimizer":
            engine.engine.optimizer.optimizer.state.clear()
        elif args.sabotage == "rng":
            torch.manual_seed(1234)
    saver = BackgroundSaver() if args.async_save else None
    while engine.step < args.steps:
        engine.train_step(build_train_batch(_table(seed=engine.step), 0, engine.version, ALGO))
        if engine.step == args.kill_after:  # trained past the last checkpoint, not saved: kill -9
            os.kill(os.getpid(), signal.SIGKILL)
        engine.save_checkpoint(CheckpointRequest(args.root, fingerprint="fixed-batches", keep_last_n=2, saver=saver))
    if saver is not None:
        saver.wait()
    save_file({n: t.contiguous() for n, t in engine.named_weights(dtype=None)}, args.out)


if __name__ == "__main__":
    main()
