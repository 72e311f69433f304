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
from learner.algorithms import token_logprobs
from learner.batch import TrainBatch, truncation_metrics
from learner.comm_timer import CommTimer
from learner.config import AlgorithmConfig, LearnerConfig
from learner.ranks import gather_step_metrics, rank_rows
from learner.losses import kl_penalty, loss_normaliser, policy_loss, token_entropy, value_loss
from learner.step_metrics import explained_variance, kish_ess_fraction, merge_metrics, staleness_histogram
from learner.step_start import StepTargets, step_targets

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
VALUE_HEAD = "value_head"
"""Attribute name of the critic's value head on the HF model (and prefix of its parameter names)."""
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


class LearnerEngine:
    """A causal LM under DeepSpeed, trained with the ``AlgorithmConfig`` algorithm
    (``learner.advantages``, ``learner.losses``).

    Critic (``advantage: gae``): a ``torch.nn.Linear(hidden_size, 1)`` value head, zero-initialised,
    registered as the submodule ``value_head`` of the HF model *before* ``deepspeed.initialize``, so
    it is trained by the same optimizer and saved/loaded in DeepSpeed checkpoints with the policy.
    It reads the last hidden state (after the final norm) of the shared trunk; ``named_weights``
    leaves it out, so vLLM never sees it. Reference model (``kl_coef > 0``): a second, frozen
    (``requires_grad=False``, eval, no grad) copy of ``config.model`` outside DeepSpeed, never
    checkpointed (it is the initial model and is reloaded from ``config.model``).

    Attributes:
        step: optimizer steps taken so far.
        version: policy version of the current weights: 0 for the loaded model, +1 per ``train_step``
            (each step publishes a new version).
        tied_lm_head: whether ``lm_head.weight`` is the input embedding (then omitted from weights).
        critic: whether the value head exists (``advantage == "gae"``).
        ref_model: the frozen reference model, or None when ``kl_coef == 0``.
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
        self.critic = algo.advantage == "gae"
        if self.critic:
            head = torch.nn.Linear(model.config.hidden_size, 1, dtype=_DTYPES[config.dtype])
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
            model.add_module(VALUE_HEAD, head)
        self.ds_config = build_ds_config(config)
        self._comm = CommTimer()
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=self.ds_config
        )
        self.device = self.engine.device
        self.ref_model = self._load_reference() if algo.kl_coef > 0 else None

    def _load_reference(self) -> torch.nn.Module:
        ref = AutoModelForCausalLM.from_pretrained(self.config.model, dtype=_DTYPES[self.config.dtype])
        ref.config.use_cache = False
        return ref.to(self.device).eval().requires_grad_(False)

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped HF model (parameters partitioned under ZeRO-3; holds ``value_head`` with a critic)."""
        return self.engine.module

    # ---- training -----------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on ``batch``: micro-batched forward/backward, clip, AdamW update.

        Every micro-batch's loss is divided by the *whole batch's* normaliser
        (``learner.losses.loss_normaliser``), so the accumulated gradient equals that of the full
        batch. With a critic or the KL in the reward, a no-grad pass over the batch with dropout off first
        computes ``V_old`` and GAE / the KL-shaped advantages (``learner.step_start.step_targets``).

        Returns:
            metrics: ``loss`` (total), ``grad_norm`` (before clipping), ``tokens`` (non-pad tokens
            forwarded), ``response_tokens``, ``step_time_s``, ``tokens_per_s``, the ``policy_loss``
            metrics (token-weighted over micro-batches; ``is_ratio_max`` is the max), ``is_ess_frac``
            (Kish ESS of ``pi_proximal / pi_behaviour`` over valid tokens, as a fraction), ``entropy``
            (token-mean nats), ``kl_to_ref`` (token-mean k3 estimate of ``KL(pi || pi_ref)``, only with
            ``kl_coef > 0``), ``value_loss`` / ``value_clip_frac`` / ``explained_variance`` (critic only),
            ``reward_mean``, ``reward_std``, ``advantage_abs_mean``, ``staleness_mean``,
            ``staleness_max``, ``staleness_hist_0 .. staleness_hist_8`` (trajectory counts per lag,
            the last bucket ``>= 8``), ``step``.
        """
        start = time.perf_counter()
        self.engine.train()
        normaliser = loss_normaliser(self.algo, batch.response_mask)  # of the whole batch, on every rank
        targets = step_targets(self, batch)
        mine, world = rank_rows(batch.batch_size, self.config.batch_split)
        loss_total, parts, rhos = 0.0, [], []
        for lo in range(mine.start, mine.stop, self.config.micro_batch_size):
            rows = slice(lo, min(lo + self.config.micro_batch_size, mine.stop))
            loss, metrics, rho = self._forward_backward(batch, rows, normaliser, targets, grad_scale=world)
            loss_total += loss
            parts.append(metrics)
            rhos.append(rho)
        if world > 1:  # every rank saw its shard only: metrics over the whole batch
            loss_total, parts, rhos = gather_step_metrics(loss_total, parts, rhos)
        local_norm = self._local_grad_norm() if self.engine.optimizer is self.engine.basic_optimizer else None
        t_update = time.perf_counter()
        self.engine.step()
        self.step += 1
        self.version += 1
        elapsed = time.perf_counter() - start
        update_s = time.perf_counter() - t_update
        tokens = float(batch.attention_mask.sum())
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = local_norm if grad_norm is None else grad_norm
        return {
            "loss": loss_total,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "tokens": tokens,
            "response_tokens": float(batch.num_response_tokens),
            "step_time_s": elapsed,
            "optimizer_step_s": update_s,
            "comm_s": self._comm.lap(),
            "micro_batches": float(len(parts)),
            "tokens_per_s": tokens / elapsed,
            **merge_metrics(parts),
            "is_ess_frac": kish_ess_fraction(torch.cat(rhos)),
            **self._batch_metrics(batch, targets),
            "step": float(self.step),
        }

    def _batch_metrics(self, batch: TrainBatch, targets: StepTargets | None) -> dict[str, float]:
        """Reward, advantage, staleness (and critic, KL-in-reward) metrics of the batch itself, and its
        ``truncated_frac`` (``overlong_penalty_mean`` with the soft overlong punishment;
        ``learner.batch.truncation_metrics``). ``reward_mean`` / ``reward_std`` are the verifier's raw rewards."""
        adv, critic = batch.advantages if targets is None else targets.advantages, {}
        adv_abs = float((adv[batch.response_mask] if adv.dim() == 2 else adv).abs().mean())
        if targets is not None and targets.old_values is not None:
            critic["explained_variance"] = explained_variance(targets.old_values, targets.returns, batch.response_mask)
        if targets is not None and targets.kl_to_ref is not None:
            critic["kl_to_ref"] = targets.kl_to_ref
        return {
            "reward_mean": float(batch.rewards.mean()),
            "reward_std": float(batch.rewards.std(unbiased=False)),
            "advantage_abs_mean": adv_abs,
            "staleness_mean": float(batch.staleness.float().mean()),
            "staleness_max": float(batch.staleness.max()),
            **staleness_histogram(batch.staleness),
            **critic,
            **truncation_metrics(batch, self.algo),
        }

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """Policy forward: ``(logits [B, L, V], values [B, L - 1] float32 or None)``; ``values[:, j]`` is
        ``V`` of the state after ``input_ids[:, :j + 1]``, aligned with ``token_logprobs``."""
        out = self.engine(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=self.critic)
        if not self.critic:
            return out.logits, None
        values = getattr(self.module, VALUE_HEAD)(out.hidden_states[-1]).squeeze(-1)
        return out.logits, values[:, :-1].float()

    def _micro_inputs(self, batch: TrainBatch, rows: slice):
        """input_ids, attention_mask (trimmed to the micro-batch's longest row), response mask, on device."""
        attention_mask = batch.attention_mask[rows]
        length = int(attention_mask.sum(dim=1).max())
        return (batch.input_ids[rows, :length].to(self.device), attention_mask[:, :length].to(self.device),
                batch.response_mask[rows, : length - 1].to(self.device))

    def _forward_backward(
        self, batch: TrainBatch, rows: slice, normaliser: float, targets: StepTargets | None, grad_scale: int = 1
    ) -> tuple[float, dict, torch.Tensor]:
        """Forward/backward one micro-batch; returns (loss, metrics, valid tokens' rho = prox/behaviour).
        ``grad_scale``: the backward loss is multiplied by it (the world size when the batch is sharded:
        DeepSpeed averages gradients over ranks, and the whole batch's gradient is their sum)."""
        input_ids, attention_mask, mask = self._micro_inputs(batch, rows)
        cols = slice(0, input_ids.shape[1] - 1)
        logits, values = self._forward(input_ids, attention_mask)
        logprobs = token_logprobs(logits, input_ids, self.algo.temperature)
        proximal = logprobs.detach()
        behaviour = batch.behaviour_logprobs[rows, cols].to(self.device)
        advantages = batch.advantages[rows] if targets is None else targets.advantages[rows]
        advantages = advantages[:, cols] if advantages.dim() == 2 else advantages
        loss, metrics = policy_loss(
            logprobs,
            proximal,  # one optimizer step per batch: the current parameters (with dropout: this forward's draw)
            behaviour,
            advantages.to(self.device),
            mask,
            self.algo,
            normaliser=normaliser,
        )
        loss = loss + self._regularisers(logits, logprobs, input_ids, attention_mask, mask, normaliser, metrics)
        if values is not None:  # the critic: targets are set
            vloss, vmetrics = value_loss(values, targets.old_values[rows, cols].to(self.device),
                                         targets.returns[rows, cols].to(self.device), mask,
                                         self.algo.value_clip, normaliser)
            loss = loss + self.algo.value_coef * vloss
            metrics["value_loss"] = float(vloss.detach()) * normaliser / max(vmetrics["valid_tokens"], 1.0)
            metrics["value_clip_frac"] = vmetrics["value_clip_frac"]
        self.engine.backward(loss * grad_scale if grad_scale != 1 else loss, scale_wrt_gas=False)
        rho = torch.exp(proximal - behaviour)[mask]
        return float(loss.detach()), metrics, rho.cpu()

    def _regularisers(
        self, logits, logprobs, input_ids, attention_mask, mask, normaliser: float, metrics: dict
    ) -> torch.Tensor | float:
        """``kl_coef * kl_estimator(x) - entropy_coef * H``, each summed over the micro-batch's valid response
        tokens and divided by the whole batch's ``normaliser`` (``H``: ``token_entropy``; the KL term only with
        ``kl_placement: loss``; ``learner.losses.kl_penalty`` says which KL its gradient follows); records the
        token-mean ``entropy`` and ``kl_to_ref`` (k3 estimate of ``KL(pi || pi_ref)``, whatever the estimator)
        in ``metrics``; 0.0 (adds nothing) when both are off."""
        n = max(float(mask.sum()), 1.0)
        with torch.set_grad_enabled(self.algo.entropy_coef > 0 and torch.is_grad_enabled()):
            entropy = token_entropy(logits, mask, self.algo.temperature).sum()
        metrics["entropy"] = float(entropy.detach()) / n
        total = -self.algo.entropy_coef * entropy / normaliser if self.algo.entropy_coef > 0 else 0.0
        if self.ref_model is not None and self.algo.kl_placement == "loss":
            ref_logprobs = self._ref_logprobs(input_ids, attention_mask)
            kl = kl_penalty(logprobs, ref_logprobs, mask, self.algo.kl_estimator).sum()
            metrics["kl_to_ref"] = float(kl_penalty(logprobs.detach(), ref_logprobs, mask, "k3").sum()) / n
            total = total + self.algo.kl_coef * kl / normaliser
        return total

    @torch.no_grad()
    def _ref_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, L - 1]`` float32 logprobs of the frozen reference model (eval mode: no dropout)."""
        ref_logits = self.ref_model(input_ids=input_ids, attention_mask=attention_mask).logits
        return token_logprobs(ref_logits, input_ids, self.algo.temperature)

    def _local_grad_norm(self) -> float:
        """2-norm of this rank's gradients; used only where DeepSpeed keeps no norm (ZeRO-0 fp32,
        whose ``clip_grad_norm_`` discards it). Pre-allreduce: exact on a world of one."""
        grads = [p.grad.detach().float().norm() for p in self.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0

    # ---- weights out --------------------------------------------------------------------------
    def named_weights(self, dtype: torch.dtype | None = torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
        """Full HF-named parameters as CPU contiguous tensors (what the rollout loads into vLLM).

        Gathered one parameter at a time under ZeRO-3. ``lm_head.weight`` is omitted when tied to the
        input embedding (vLLM ties it), and so is the critic's ``value_head`` (not part of the policy).
        ``dtype=None`` keeps the training dtype.
        """
        out = []
        for name, param in self.module.named_parameters():
            if (self.tied_lm_head and name == "lm_head.weight") or name.startswith(VALUE_HEAD + "."):
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
                        fingerprint: str = "", keep_last_n: int | None = None, saver=None, after_commit=None,
                        pending_group_ids: list[str] = ()):
        """Commit ``{root}/global_step_{step}`` (a ``Future`` of it with a ``saver``: async save); see
        ``learner.ckpt_engine.save_checkpoint``."""
        from learner.ckpt_engine import save_checkpoint

        return save_checkpoint(self, root, pending_lease_ids, acked_lease_count, fingerprint, keep_last_n, saver,
                               after_commit, pending_group_ids)

    def load_checkpoint(self, path: Path, fingerprint: str = "", force: bool = False) -> ckpt.CheckpointMetadata:
        """Restore from ``path``; see ``learner.ckpt_engine.load_checkpoint``."""
        from learner.ckpt_engine import load_checkpoint

        return load_checkpoint(self, path, fingerprint, force)

