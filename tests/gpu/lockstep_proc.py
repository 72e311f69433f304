"""Child process for ``test_lockstep_cuda``: a lockstep learner process (``deterministic_kernels`` before CUDA
starts) trains a model on fixed batches, checkpointing every step; optionally SIGKILLs itself after a step it
trained but did not save, or first resumes from the newest verified checkpoint.

    python -m tests.gpu.lockstep_proc MODEL ROOT OUT STEPS [--kill-after N] [--resume] [--dtype bf16|fp32]
        [--zero 2|3] [--batch-seed S]

Writes ``{"versions": {step: sha256 of the published weights}, "device": ...}`` to OUT (JSON): the hash
``proto.lockstep.VersionStore`` compares when a resumed learner re-writes a version.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

from gyre.learner.versions import LockstepPublishing


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("model", "root", "out"):
        p.add_argument(name)
    p.add_argument("steps", type=int)
    p.add_argument("--kill-after", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--zero", type=int, default=2, choices=[2, 3])
    p.add_argument("--batch-seed", type=int, default=0)
    args = p.parse_args()
    LockstepPublishing.prepare_process()  # what the learner actor runs first in lockstep: before CUDA starts

    import torch

    from gyre.learner.checkpoint import store as ckpt
    from gyre.learner.checkpoint.request import CheckpointRequest
    from gyre.learner.config import AlgorithmConfig, LearnerConfig
    from gyre.learner.engine import LearnerEngine
    from gyre.proto.lockstep import weights_sha256
    from tests.gpu.test_learner_cuda import SHAPE, _batch

    algo = AlgorithmConfig()
    cfg = LearnerConfig(model=args.model, zero_stage=args.zero, dtype=args.dtype, micro_batch_size=SHAPE["micro"],
                        lr=1e-3, seed=7)
    engine = LearnerEngine(cfg, algo)
    out = Path(args.out)
    versions = json.loads(out.read_text())["versions"] if args.resume and out.exists() else {}
    if args.resume:
        engine.load_checkpoint(ckpt.resolve_resume("auto", args.root), fingerprint="fixed-batches")
    while engine.step < args.steps:
        engine.train_step(_batch(SHAPE, seed=args.batch_seed + engine.step, learner_version=engine.version, algo=algo))
        versions[str(engine.version)] = weights_sha256(engine.named_weights())
        out.write_text(json.dumps({"versions": versions, "device": str(engine.device),
                                   "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))
        if engine.step == args.kill_after:  # trained (and published) past the last checkpoint, not saved: kill -9
            os.kill(os.getpid(), signal.SIGKILL)
        engine.save_checkpoint(CheckpointRequest(args.root, fingerprint="fixed-batches", keep_last_n=2))


if __name__ == "__main__":
    main()
