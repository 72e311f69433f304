"""Child process for ``test_learner_resume``: train the tiny model on fixed batches, checkpointing every
step; optionally SIGKILL itself mid-run, or resume from the newest verified checkpoint first.

    python -m tests.integration.learner_resume_proc MODEL ROOT OUT STEPS [--kill-after N] [--resume]
        [--sabotage optimizer|rng|kl] [--async-save] [--kl-adaptive]

Writes the final fp32 parameters to OUT (safetensors). ``--sabotage`` deliberately breaks the resume
(drops the optimizer state or re-seeds the RNG after loading) so the test can show it would notice.
``--async-save`` writes every checkpoint in the background (``learner.async_save``) while training goes on.
``--kl-adaptive`` trains with a KL term under the adaptive controller (``learner.algo.kl_control``) and also writes
``OUT.kl.json``: ``[[step, kl_coef used, kl_to_ref], ...]`` of the steps this process trained, and the
controller's final value; ``--sabotage kl`` then drops the controller's restored state (back to ``kl_coef``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
from safetensors.torch import save_file

from gyre.learner.checkpoint import store as ckpt
from gyre.learner.checkpoint.async_save import BackgroundSaver
from gyre.learner.batch import build_train_batch
from gyre.learner.checkpoint.request import CheckpointRequest
from gyre.learner.config import AlgorithmConfig, LearnerConfig
from gyre.learner.algo.kl_control import KLController
from gyre.learner.engine import LearnerEngine
from tests.integration.test_learner_engine import _table

ALGO = AlgorithmConfig()
KL_ALGO = AlgorithmConfig(kl_coef=0.05, kl_estimator="k3", kl_ctrl={"type": "adaptive", "target_kl": 1.2e-3,
                                                                    "horizon": 20})
"""Target near the KL these steps reach (~1e-3 with dropout 0.1), so the error is mostly inside the +-0.2 clip and
beta depends on each step's exact KL; horizon 20 over 6-row batches: it moves by up to 6% a step."""


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("model", "root", "out"):
        p.add_argument(name)
    p.add_argument("steps", type=int)
    p.add_argument("--kill-after", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--sabotage", choices=["optimizer", "rng", "kl"])
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--kl-adaptive", action="store_true")
    args = p.parse_args()
    algo = KL_ALGO if args.kl_adaptive else ALGO
    torch.set_num_threads(1)
    cfg = LearnerConfig(model=args.model, zero_stage=2, dtype="fp32", micro_batch_size=2, lr=1e-3, seed=7)
    engine = LearnerEngine(cfg, algo)
    if args.resume:
        engine.load_checkpoint(ckpt.resolve_resume("auto", args.root), fingerprint="fixed-batches")
        if args.sabotage == "optimizer":
            engine.engine.optimizer.optimizer.state.clear()
        elif args.sabotage == "rng":
            torch.manual_seed(1234)
        elif args.sabotage == "kl":
            engine.kl_ctrl = KLController(algo.kl_coef, algo.kl_ctrl)
    saver = BackgroundSaver() if args.async_save else None
    kl = []
    while engine.step < args.steps:
        row = engine.train_step(build_train_batch(_table(seed=engine.step), 0, engine.version, algo))
        if args.kl_adaptive:
            kl.append([engine.step, row["kl_coef"], row["kl_to_ref"]])
            with open(f"{args.out}.kl.json", "w") as f:  # before a kill -9: the steps trained so far
                json.dump({"steps": kl, "final": engine.kl_ctrl.value}, f)
        if engine.step == args.kill_after:  # trained past the last checkpoint, not saved: kill -9
            os.kill(os.getpid(), signal.SIGKILL)
        engine.save_checkpoint(CheckpointRequest(args.root, fingerprint="fixed-batches", keep_last_n=2, saver=saver))
    if saver is not None:
        saver.wait()
    save_file({n: t.contiguous() for n, t in engine.named_weights(dtype=None)}, args.out)


if __name__ == "__main__":
    main()
