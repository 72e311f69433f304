"""The DeepSpeed learner engine: one optimizer step per ``TrainBatch``, weights out for the rollout.

The only module of gyre that imports deepspeed. Runs on CPU (gloo) or GPU (nccl) alike; a lone
process initialises a world-size-1 process group itself.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Any

import deepspeed
import structlog
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from learner import checkpoint as ckpt
from learner.algorithms import policy_loss, token_logprobs
from learner.batch import TrainBatch
from learner.config import AlgorithmConfig, LearnerConfig

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_MAX_METRICS = ("is_ratio_max",)
log = structlog.get_logger("learner")


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


class LearnerEngine:
    """A causal LM under DeepSpeed, trained with GRPO + decoupled PPO/TIS (``learner.algorithms``).

    Attributes:
        step: optimizer steps taken so far.
        version: policy version of the current weights: 0 for the loaded model, +1 per ``train_step``
            (each step publishes a new version).
        tied_lm_head: whether ``lm_head.weight`` is the input embedding (then omitted from weights).
    """

    def __init__(self, config: LearnerConfig, algo: AlgorithmConfig) -> None:
        self.config = config
        self.algo = algo
        self.step = 0
        self.version = 0
        self.config_hash = ckpt.config_hash(config.model_dump_json() + algo.model_dump_json())
        ensure_distributed()
        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=_DTYPES[config.dtype])
        model.config.use_cache = False
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        out_emb = model.get_output_embeddings()
        self.tied_lm_head = out_emb is not None and out_emb.weight is model.get_input_embeddings().weight
        self.ds_config = build_ds_config(config)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=self.ds_config
        )
        self.device = self.engine.device

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped HF model (parameters partitioned under ZeRO-3)."""
        return self.engine.module

    # ---- training -----------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on ``batch``: micro-batched forward/backward, clip, AdamW update.

        Every micro-batch's loss is divided by the *whole batch's* valid-token count, so the
        accumulated gradient equals that of a single token-mean over the batch.

        Returns:
            metrics: ``loss``, ``grad_norm`` (before clipping), ``tokens`` (non-pad tokens forwarded),
            ``response_tokens``, ``step_time_s``, ``tokens_per_s``, the ``policy_loss`` metrics
            (token-weighted over micro-batches; ``is_ratio_max`` is the max), ``reward_mean``,
            ``reward_std``, ``advantage_abs_mean``, ``staleness_mean``, ``staleness_max``, ``step``.
        """
        start = time.perf_counter()
        self.engine.train()
        normaliser = float(max(batch.num_response_tokens, 1))
        loss_total, parts = 0.0, []
        for lo in range(0, batch.batch_size, self.config.micro_batch_size):
            rows = slice(lo, lo + self.config.micro_batch_size)
            loss, metrics = self._forward_backward(batch, rows, normaliser)
            loss_total += loss
            parts.append(metrics)
        local_norm = self._local_grad_norm() if self.engine.optimizer is self.engine.basic_optimizer else None
        self.engine.step()
        self.step += 1
        self.version += 1
        elapsed = time.perf_counter() - start
        tokens = float(batch.attention_mask.sum())
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = local_norm if grad_norm is None else grad_norm
        return {
            "loss": loss_total,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "tokens": tokens,
            "response_tokens": float(batch.num_response_tokens),
            "step_time_s": elapsed,
            "tokens_per_s": tokens / elapsed,
            **_merge_metrics(parts),
            "reward_mean": float(batch.rewards.mean()),
            "reward_std": float(batch.rewards.std(unbiased=False)),
            "advantage_abs_mean": float(batch.advantages.abs().mean()),
            "staleness_mean": float(batch.staleness.float().mean()),
            "staleness_max": float(batch.staleness.max()),
            "step": float(self.step),
        }

    def _forward_backward(self, batch: TrainBatch, rows: slice, normaliser: float) -> tuple[float, dict]:
        """Forward/backward one micro-batch (trimmed to its longest row); returns (loss, metrics)."""
        attention_mask = batch.attention_mask[rows]
        length = int(attention_mask.sum(dim=1).max())
        input_ids = batch.input_ids[rows, :length].to(self.device)
        attention_mask = attention_mask[:, :length].to(self.device)
        logits = self.engine(input_ids=input_ids, attention_mask=attention_mask).logits
        logprobs = token_logprobs(logits, input_ids, self.algo.temperature)
        loss, metrics = policy_loss(
            logprobs,
            logprobs.detach(),  # one optimizer step per batch: proximal == current at step start
            batch.behaviour_logprobs[rows, : length - 1].to(self.device),
            batch.advantages[rows].to(self.device),
            batch.response_mask[rows, : length - 1].to(self.device),
            self.algo,
            normaliser=normaliser,
        )
        self.engine.backward(loss, scale_wrt_gas=False)
        return float(loss.detach()), metrics

    def _local_grad_norm(self) -> float:
        """2-norm of this rank's gradients; used only where DeepSpeed keeps no norm (ZeRO-0 fp32,
        whose ``clip_grad_norm_`` discards it). Pre-allreduce: exact on a world of one."""
        grads = [p.grad.detach().float().norm() for p in self.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0

    # ---- weights out --------------------------------------------------------------------------
    def named_weights(self, dtype: torch.dtype | None = torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
        """Full HF-named parameters as CPU contiguous tensors (what the rollout loads into vLLM).

        Gathered one parameter at a time under ZeRO-3. ``lm_head.weight`` is omitted when tied to the
        input embedding (vLLM ties it). ``dtype=None`` keeps the training dtype.
        """
        out = []
        for name, param in self.module.named_parameters():
            if self.tied_lm_head and name == "lm_head.weight":
                continue
            with self._gathered([param]):
                tensor = param.detach().to("cpu", dtype=dtype or param.dtype, copy=True).contiguous()
            out.append((name, tensor))
        return out

    def _gathered(self, params: list[torch.nn.Parameter]):
        if self.config.zero_stage == 3:
            return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        return contextlib.nullcontext()

    def export_hf(self, out_dir: Path, tokenizer_dir: str) -> None:
        """Write an HF folder (safetensors in the training dtype + config + tokenizer) to ``out_dir``."""
        out_dir = Path(out_dir)
        state = dict(self.named_weights(dtype=None))
        if dist.get_rank() == 0:
            self.module.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
        dist.barrier()

    # ---- checkpoints (learner.ckpt_engine) ------------------------------------------------------
    def save_checkpoint(self, root: Path, pending_lease_ids: list[str] = (), acked_lease_count: int = 0,
                        fingerprint: str = "", keep_last_n: int | None = None) -> Path:
        """Commit ``{root}/global_step_{step}``; see ``learner.ckpt_engine.save_checkpoint``."""
        from learner.ckpt_engine import save_checkpoint

        return save_checkpoint(self, root, pending_lease_ids, acked_lease_count, fingerprint, keep_last_n)

    def load_checkpoint(self, path: Path, fingerprint: str = "", force: bool = False) -> ckpt.CheckpointMetadata:
        """Restore from ``path``; see ``learner.ckpt_engine.load_checkpoint``."""
        from learner.ckpt_engine import load_checkpoint

        return load_checkpoint(self, path, fingerprint, force)


def _merge_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Token-weighted mean of per-micro-batch metrics (max for ``*_max``), dropping ``valid_tokens``."""
    total = sum(p["valid_tokens"] for p in parts)
    merged: dict[str, float] = {}
    for key in parts[0]:
        if key == "valid_tokens":
            continue
        if key in _MAX_METRICS:
            merged[key] = max(p[key] for p in parts if p["valid_tokens"] > 0) if total else 0.0
        else:
            merged[key] = sum(p[key] * p["valid_tokens"] for p in parts) / total if total else 0.0
    return merged
