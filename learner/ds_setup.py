"""The DeepSpeed engine's setup: its config dict and the process group a learner rank joins."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from learner.config import LearnerConfig

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_ds_config(config: LearnerConfig) -> dict[str, Any]:
    """The DeepSpeed config dict for ``config``.

    The caller owns the accumulation boundary (``managed_gradient_accumulation: false``): every
    ``backward`` accumulates, the single ``step()`` per batch reduces, clips and updates, so a batch of
    any size (``ceil(B / micro_batch_size)`` micro-batches) makes exactly one update, and
    ``gradient_accumulation_steps`` stays 1 (losses are pre-normalised, never divided by it).
    The optimizer is ``torch.optim.AdamW`` (``torch_adam``): DeepSpeed's FusedAdam needs CUDA and its
    CPUAdam a JIT-built op, and torch's AdamW is on ZeRO's supported list at every stage.
    With bf16 and ZeRO >= 1 gradients accumulate in fp32 (``grad_accum_dtype``).
    """
    optimizer_params = {
        "lr": config.lr,
        "betas": list(config.betas),
        "eps": config.adam_eps,
        "weight_decay": config.weight_decay,
        "torch_adam": True,
    }
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "optimizer": {"type": "AdamW", "params": optimizer_params},
        "gradient_clipping": config.grad_clip,
        "bf16": {"enabled": config.dtype == "bf16"},
        "zero_optimization": {"stage": config.zero_stage},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if config.dtype == "bf16" and config.zero_stage >= 1:
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    if config.offload_optimizer == "cpu":
        # ZeRO-Offload (Ren et al. 2021): optimizer states and the update live in host memory. torch's
        # AdamW instead of the JIT-built DeepSpeedCPUAdam (same math, slower on big models).
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        ds["zero_force_ds_cpu_optimizer"] = False
    if config.log_comm_time:
        ds["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False, "debug": False}
    return ds


def ensure_distributed() -> None:
    """Initialise torch.distributed from ``RANK``/``WORLD_SIZE``/``MASTER_*`` env, defaulting to a
    world of one on a free localhost port. No-op when already initialised."""
    if dist.is_initialized():
        return
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    for key, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, default)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
