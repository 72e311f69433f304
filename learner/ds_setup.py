"""The DeepSpeed engines' setup: the policy's and the reference model's config dicts, and the process group a
learner rank joins."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from gyre.learner.config import LearnerConfig

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
        "train_micro_batch_size_per_gpu": config.rows_per_micro_batch,
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


def build_ref_ds_config(config: LearnerConfig) -> dict[str, Any]:
    """The DeepSpeed config dict of the frozen reference model (``kl_coef > 0``) when the policy runs ZeRO-3.

    ZeRO-3 for inference, as OpenRLHF's ``get_eval_ds_config`` for its initial model: no optimizer (DeepSpeed
    then only partitions the parameters, ``DeepSpeedZeRoOffload``), each rank keeps ``1 / world`` of every
    parameter (``ds_tensor``) and a forward gathers each layer's parameters for the duration of that layer, like
    the policy's. bf16 as the policy (``config.dtype``). With ``offload_optimizer: cpu`` (a learner short of
    accelerator memory) the reference's partitions live in host memory too (``offload_param``; pinned on CUDA):
    its forward then copies each layer in from the host, which costs step time but no accelerator memory for the
    reference between its forwards. Batch sizes are the policy's (DeepSpeed requires them; no step is taken).
    Under ZeRO 0-2 the learner keeps the reference unwrapped (``learner.engine``): the policy's parameters are a
    full copy on every rank there, and so are the reference's.
    """
    zero: dict[str, Any] = {"stage": 3}
    if config.offload_optimizer == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": config.rows_per_micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": config.dtype == "bf16"},
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def ensure_distributed() -> None:
    """Initialise torch.distributed (NCCL with CUDA, else gloo). No-op when already initialised.

    With ``MASTER_PORT`` in the env (a multi-rank learner's launcher sets it, with ``RANK``/``WORLD_SIZE``):
    torch's ``env://`` rendezvous there (``MASTER_ADDR`` defaults to 127.0.0.1). Without it: a world of one,
    on a TCPStore this process binds on a port the OS picks (port 0, read back by the store), so no port is
    chosen ahead, released and bound later, when another process may have taken it (EADDRINUSE). ``RANK`` and
    ``LOCAL_RANK`` default to 0, ``WORLD_SIZE`` to 1.

    Raises:
        ValueError: ``WORLD_SIZE`` > 1 without ``MASTER_PORT`` (the other ranks could never find rank 0).
    """
    if dist.is_initialized():
        return
    for key, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, default)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "MASTER_PORT" in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        return
    if world_size != 1:
        raise ValueError(f"WORLD_SIZE ({world_size}) > 1 needs MASTER_ADDR and MASTER_PORT: the rendezvous of rank 0")
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    dist.init_process_group(backend, store=store, rank=rank, world_size=1)
