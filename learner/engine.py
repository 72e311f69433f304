"""The DeepSpeed learner engine: one optimizer step per ``TrainBatch``, weights out for the rollout.

The only module of gyre that imports deepspeed. Runs on CPU (gloo) or GPU (nccl) alike; a lone
process initialises a world-size-1 process group itself.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import structlog
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from gyre.learner.checkpoint import store as ckpt
from gyre.learner.checkpoint import engine as ckpt_engine
from gyre.learner.batch import TrainBatch
from gyre.learner.comm_timer import CommTimer
from gyre.learner.checkpoint.request import CheckpointRequest
from gyre.learner.config import AlgorithmConfig, LearnerConfig
from gyre.learner.ds_setup import _DTYPES, build_ds_config, build_ref_ds_config, ensure_distributed
from gyre.learner.jit_ops import load_comm_op
from gyre.learner.algo.kl_control import KLController
from gyre.learner.algo.objective_check import check_objectives
from gyre.learner.algo.objectives import custom_policy_loss
from gyre.learner.forward import MicroPass, packed_pass
from gyre.learner.micro_batches import row_count_plan, token_budget_plan
from gyre.learner.packing import PackedRows, packed_attn_implementation
from gyre.learner.ranks import gather_step_metrics
from gyre.learner.algo.losses import (kl_penalty, loss_normaliser, policy_loss, row_token_scale, scaled_token_sum,
                            value_loss)
from gyre.learner.step_metrics import batch_metrics, kish_ess_fraction, merge_metrics
from gyre.learner.step_start import StepTargets, mini_batch_rows, proximal_logprobs, step_targets
from gyre.learner.weight_capture import VALUE_HEAD, capture_weights, host_weights

"""Attribute name of the critic's value head on the HF model (and prefix of its parameter names)."""
log = structlog.get_logger("learner")


@dataclass(frozen=True)
class _Update:
    """One optimizer update's results: summed loss (float), grad norm before clipping (float), seconds in
    ``engine.step()``, per-micro-batch metric dicts and ``[N]`` float32 importance ratios."""

    loss: float
    grad_norm: float
    update_s: float
    parts: list[dict]
    rhos: list[torch.Tensor]


class LearnerEngine:
    """A causal LM under DeepSpeed, trained with the ``AlgorithmConfig`` algorithm
    (``learner.algo.advantages``, ``learner.algo.losses``).

    Critic (``advantage: gae``): a ``torch.nn.Linear(hidden_size, 1)`` value head, zero-initialised,
    registered as the submodule ``value_head`` of the HF model *before* ``deepspeed.initialize``, so
    it is trained by the same optimizer and saved/loaded in DeepSpeed checkpoints with the policy.
    It reads the last hidden state (after the final norm) of the shared trunk; ``named_weights``
    leaves it out, so vLLM never sees it. Reference model (``kl_coef > 0``): a second, frozen
    (``requires_grad=False``, eval, no grad) copy of ``config.model``, sharded like the policy (ZeRO-3: its own
    DeepSpeed inference engine; ZeRO 0-2: a full copy per rank, ``_load_reference``), never
    checkpointed (it is the initial model and is reloaded from ``config.model``).

    Attributes:
        step: optimizer steps taken so far.
        version: policy version of the current weights: 0 for the loaded model, +1 per ``train_step``
            (each step publishes a new version).
        tied_lm_head: whether ``lm_head.weight`` is the input embedding (then omitted from weights).
        critic: whether the value head exists (``advantage == "gae"``).
        ref_model: the frozen reference model, or None when ``kl_coef == 0``.
        kl_ctrl: the KL coefficient's controller (``learner.algo.kl_control``); ``kl_ctrl.value`` is the ``beta``
            the next step uses, updated after each ``train_step`` and saved in checkpoints.
    """

    def __init__(self, config: LearnerConfig, algo: AlgorithmConfig) -> None:
        self.config = config
        self.algo = algo
        check_objectives(algo)  # a custom advantage / loss imports and passes its synthetic check on this rank
        self.step = 0
        self.version = 0
        self.config_hash = ckpt.config_hash(config.model_dump_json() + algo.model_dump_json())
        ensure_distributed()
        load_comm_op()  # before deepspeed.initialize: a dead process's build lock must not hang this one
        torch.manual_seed(config.seed)
        self.attn_implementation = packed_attn_implementation(config.attn_kernel, _local_device(), _DTYPES[config.dtype])
        model = AutoModelForCausalLM.from_pretrained(config.model, dtype=_DTYPES[config.dtype],
                                                     attn_implementation=self.attn_implementation)
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
        self.kl_ctrl = KLController(algo.kl_coef, algo.kl_ctrl)

    def _load_reference(self) -> torch.nn.Module:
        """The frozen reference model for the KL term: ``config.model`` loaded again, eval, no grad, sharded like the
        policy. Under ZeRO-3 it is wrapped by ``deepspeed.initialize`` with ``ds_setup.build_ref_ds_config`` (no
        optimizer): each rank keeps ``1 / world`` of its parameters (in host memory with ``offload_optimizer:
        cpu``) and its forward gathers them layer by layer, a collective that every rank runs as it runs the
        policy's forwards. Under ZeRO 0-2 the policy is a full copy on every rank and so is the reference (no
        wrapper). Returns what ``_ref_logprobs`` runs its packed pass on (``learner.forward.packed_pass``): the
        ``DeepSpeedEngine`` (ZeRO-3) or the HF model on ``self.device``, loaded with the policy's packed attention."""
        ref = AutoModelForCausalLM.from_pretrained(self.config.model, dtype=_DTYPES[self.config.dtype],
                                                   attn_implementation=self.attn_implementation)
        ref.config.use_cache = False
        ref.eval().requires_grad_(False)
        if self.config.zero_stage != 3:
            return ref.to(self.device)
        ref_engine, _, _, _ = deepspeed.initialize(model=ref, config=build_ref_ds_config(self.config))
        ref_engine.eval()  # DeepSpeedEngine.eval returns None
        return ref_engine

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped HF model (parameters partitioned under ZeRO-3; holds ``value_head`` with a critic)."""
        return self.engine.module

    # ---- training -----------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Train on one sampled batch: ``ppo_epochs`` passes, each of ``mini_batches`` optimizer updates
        (micro-batched forward/backward, clip, AdamW), then one new policy version.

        Every micro-batch's loss is divided by its *whole mini-batch's* normaliser
        (``learner.algo.losses.loss_normaliser``, ``loss_agg_mode``), so the accumulated gradient of an update equals
        that of the mini-batch at once. With a critic or the KL in the reward, a no-grad pass over the batch
        with dropout off first computes ``V_old`` and GAE / the KL-shaped advantages
        (``learner.step_start.step_targets``); with more than one update, another computes the proximal
        logprobs every update is clipped against (``learner.step_start.proximal_logprobs``). With one update
        the anchor is the training forward's own logprobs, detached: the same parameters, so the clip is inert.

        Returns:
            metrics: ``loss`` and ``grad_norm`` (before clipping), each the mean over the updates, ``updates``,
            ``tokens`` (non-pad tokens of the batch), ``response_tokens``, ``step_time_s``,
            ``optimizer_step_s`` (summed over updates), ``tokens_per_s``, the ``policy_loss`` metrics
            (token-weighted over every update's micro-batches; ``is_ratio_max`` is the max; with a custom
            ``loss``, ``learner.objectives.custom_policy_loss``'s: the ratio diagnostics and ``custom_loss/<name>``),
            ``is_ess_frac`` (Kish ESS of ``pi_proximal / pi_behaviour`` over valid tokens, as a fraction), ``entropy``
            (token-mean nats), ``kl_to_ref`` (token-mean k3 estimate of ``KL(pi || pi_ref)``, only with
            ``kl_coef > 0``; then also ``kl_coef``, the ``beta`` this step used), ``value_loss`` /
            ``value_clip_frac`` / ``explained_variance`` (critic only),
            ``reward_mean``, ``reward_std`` (the verifier's raw reward), ``truncated_frac`` (and
            ``overlong_penalty_mean`` with ``overlong_buffer_len``), ``advantage_abs_mean``, ``staleness_mean``,
            ``staleness_max``, ``staleness_hist_0 .. staleness_hist_8`` (trajectory counts per lag,
            the last bucket ``>= 8``), ``step``.

        Raises:
            ValueError: the batch's rows are not a multiple of ``mini_batches`` (times the world size when
                sharded).
        """
        start = time.perf_counter()
        self.engine.train()
        plan = mini_batch_rows(batch.batch_size, self.algo.mini_batches)
        targets = step_targets(self, batch)
        proximal = None
        if self.algo.updates_per_batch > 1:
            proximal = proximal_logprobs(self, batch, [m for rows in plan for m in self._micro_plan(batch, rows)[0]
                                                       if m is not None])
        updates = [self._update(batch, rows, targets, proximal) for _ in range(self.algo.ppo_epochs) for rows in plan]
        self.step += 1
        self.version += 1
        elapsed = time.perf_counter() - start
        tokens = float(batch.attention_mask.sum())
        parts = [p for u in updates for p in u.parts]
        metrics = {
            "loss": sum(u.loss for u in updates) / len(updates),
            "grad_norm": sum(u.grad_norm for u in updates) / len(updates),
            "updates": float(len(updates)),
            "tokens": tokens,
            "response_tokens": float(batch.num_response_tokens),
            "step_time_s": elapsed,
            "optimizer_step_s": sum(u.update_s for u in updates),
            "comm_s": self._comm.lap(),
            "micro_batches": float(len(parts)),
            "tokens_per_s": tokens / elapsed,
            **merge_metrics(parts),
            "is_ess_frac": kish_ess_fraction(torch.cat([r for u in updates for r in u.rhos])),
            **batch_metrics(batch, targets, self.algo),
            "step": float(self.step),
        }
        if self.ref_model is not None:  # this step's beta, then the controller's update for the next step
            metrics["kl_coef"] = self.kl_ctrl.value
            self.kl_ctrl.update(metrics["kl_to_ref"], batch.batch_size)
        return metrics

    def _micro_plan(self, batch: TrainBatch, rows: range | None = None) -> tuple[list[torch.Tensor | None], int]:
        """This rank's micro-batches of the mini-batch ``rows`` (``None``: the whole batch, every row on this rank)
        as ``[b]`` int64 row indices (``None``: an empty micro-batch, run at zero weight so every rank makes the
        same collectives), and the gradient scale: the data-parallel world size when the rows are sharded
        (DeepSpeed averages gradients over ranks; the mini-batch's gradient is their sum), else 1.
        ``learner.micro_batches``: ``micro_batch_tokens`` budgets balanced over ranks, or ``micro_batch_size``
        rows."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if rows is None or self.config.batch_split != "shard":
            world = 1
        rank = dist.get_rank() if world > 1 else 0
        rows = range(batch.batch_size) if rows is None else rows
        if self.config.micro_batch_tokens is not None:
            plan = token_budget_plan(batch.attention_mask.sum(dim=1), rows, world, self.config.micro_batch_tokens)
        else:
            plan = row_count_plan(rows, world, self.config.rows_per_micro_batch)
        return [None if m is None else torch.tensor(m, dtype=torch.int64) for m in plan[rank]], world

    def _update(self, batch: TrainBatch, rows: range, targets: StepTargets | None,
                proximal: torch.Tensor | None) -> _Update:
        """One optimizer update on the mini-batch ``rows``: forward/backward of this rank's micro-batches, each
        normalised by the whole mini-batch (``loss_agg_mode``), then ``engine.step()``."""
        mask = batch.response_mask[rows.start:rows.stop]
        normaliser = loss_normaliser(self.algo, mask)  # of the whole mini-batch, on every rank
        row_scale = row_token_scale(self.algo, batch.response_mask)
        micro, world = self._micro_plan(batch, rows)
        loss_total, parts, rhos = 0.0, [], []
        for idx in micro:
            if idx is None:  # this rank has no rows left for it: the collectives only (zero gradient)
                shortest = min(rows, key=lambda r: int(batch.attention_mask[r].sum()))
                self._forward_backward(batch, torch.tensor([shortest]), normaliser, targets, proximal, row_scale,
                                       0)
                continue
            loss, metrics, rho = self._forward_backward(batch, idx, normaliser, targets, proximal, row_scale, world)
            loss_total += loss
            parts.append(metrics)
            rhos.append(rho)
        if world > 1:  # every rank saw its shard only: metrics over the whole mini-batch
            loss_total, parts, rhos = gather_step_metrics(loss_total, parts, rhos)
        local_norm = self._local_grad_norm() if self.engine.optimizer is self.engine.basic_optimizer else None
        self._sync_cuda()  # queued backward kernels count as forward/backward, not as the optimizer's
        t_update = time.perf_counter()
        self.engine.step()
        self._sync_cuda()
        update_s = time.perf_counter() - t_update
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = local_norm if grad_norm is None else grad_norm
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        return _Update(loss_total, grad_norm, update_s, parts, rhos)

    def _sync_cuda(self) -> None:
        """Wait for this rank's queued CUDA kernels, so ``optimizer_step_s`` (and ``time/learner/*``,
        ``learner.step_timer``) time the optimizer's kernels rather than their launch; two syncs per update, on
        CUDA only (a CPU engine runs eagerly)."""
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)

    def _pass(self, batch: TrainBatch, rows: torch.Tensor, entropy: bool = False) -> MicroPass:
        """The policy's packed forward of ``rows`` (``learner.forward.packed_pass``): ``[b, W - 1]`` logprobs of the
        response tokens (entropy too when asked), and the critic's values when there is one."""
        packed = PackedRows.build(batch.input_ids, batch.attention_mask, rows, self.device)
        mask = batch.response_mask[rows, : packed.max_len - 1].to(self.device)
        head = getattr(self.module, VALUE_HEAD) if self.critic else None
        return packed_pass(self.engine, packed, mask, self.algo.temperature, self.config.logits_chunk, entropy, head)

    def _forward_backward(
        self, batch: TrainBatch, rows: torch.Tensor, normaliser: float, targets: StepTargets | None,
        proximal_all: torch.Tensor | None = None, row_scale: torch.Tensor | None = None, grad_scale: int = 1,
    ) -> tuple[float, dict, torch.Tensor]:
        """Forward/backward one packed micro-batch (``rows``: ``[b]`` int64 batch rows); returns (loss, metrics,
        valid tokens' rho = prox/behaviour). ``grad_scale`` 0 runs the passes at zero weight (an empty
        micro-batch's collectives).
        ``proximal_all``: ``[B, L - 1]`` proximal logprobs of the batch (None: this forward's own, detached).
        ``row_scale``: ``[B]`` (``learner.algo.losses.row_token_scale``) or None. ``grad_scale``: the backward loss is
        multiplied by it (the world size when the batch is sharded: DeepSpeed averages gradients over ranks,
        and the whole batch's gradient is their sum)."""
        out = self._pass(batch, rows, entropy=True)
        mask, logprobs, values = out.mask, out.logprobs, out.values
        cols = slice(0, mask.shape[1])
        proximal = logprobs.detach() if proximal_all is None else proximal_all[rows, cols].to(self.device)
        scale = None if row_scale is None else row_scale[rows]
        behaviour = batch.behaviour_logprobs[rows, cols].to(self.device)
        advantages = batch.advantages[rows] if targets is None else targets.advantages[rows]
        advantages = advantages[:, cols] if advantages.dim() == 2 else advantages
        loss, metrics = (custom_policy_loss if self.algo.custom_loss else policy_loss)(
            logprobs,
            proximal,  # one update per batch: the current parameters (with dropout: this forward's draw)
            behaviour,
            advantages.to(self.device),
            mask,
            self.algo,
            normaliser=normaliser,
            row_scale=scale,
        )
        loss = loss + self._regularisers(out, batch, rows, normaliser, scale, metrics)
        if values is not None:  # the critic: targets are set
            vloss, vmetrics = value_loss(values, targets.old_values[rows, cols].to(self.device),
                                         targets.returns[rows, cols].to(self.device), mask,
                                         self.algo.value_clip, normaliser, scale)
            loss = loss + self.algo.value_coef * vloss
            metrics["value_loss"] = vmetrics["value_loss"]  # token mean; vloss is scaled by the aggregation
            metrics["value_clip_frac"] = vmetrics["value_clip_frac"]
        self.engine.backward(loss * grad_scale if grad_scale != 1 else loss, scale_wrt_gas=False)
        rho = torch.exp(proximal - behaviour)[mask]
        return float(loss.detach()), metrics, rho.cpu()

    def _regularisers(
        self, out: MicroPass, batch: TrainBatch, rows: torch.Tensor, normaliser: float, row_scale, metrics: dict
    ) -> torch.Tensor | float:
        """``beta * kl_estimator(x) - entropy_coef * H`` (``beta``: ``kl_ctrl.value``), each summed over the
        micro-batch's valid response tokens (times ``row_scale``) and divided by the whole mini-batch's ``normaliser`` (``H``: ``token_entropy``; the KL term only with
        ``kl_placement: loss``; ``learner.algo.losses.kl_penalty`` says which KL its gradient follows); records the
        token-mean ``entropy`` and ``kl_to_ref`` (k3 estimate of ``KL(pi || pi_ref)``, whatever the estimator)
        in ``metrics``; 0.0 (adds nothing) when both are off."""
        mask, logprobs = out.mask, out.logprobs
        n = max(float(mask.sum()), 1.0)
        entropy_t = out.entropy if self.algo.entropy_coef > 0 else out.entropy.detach()
        entropy = entropy_t.sum()
        metrics["entropy"] = float(entropy.detach()) / n
        if self.algo.entropy_coef > 0:
            bonus = entropy if row_scale is None else scaled_token_sum(entropy_t, mask, row_scale)
            total = -self.algo.entropy_coef * bonus / normaliser
        else:
            total = 0.0
        if self.ref_model is not None and self.algo.kl_placement == "loss":
            ref_logprobs = self._ref_logprobs(batch, rows)
            kl_t = kl_penalty(logprobs, ref_logprobs, mask, self.algo.kl_estimator)
            kl = kl_t.sum() if row_scale is None else scaled_token_sum(kl_t, mask, row_scale)
            metrics["kl_to_ref"] = float(kl_penalty(logprobs.detach(), ref_logprobs, mask, "k3").sum()) / n
            total = total + self.kl_ctrl.value * kl / normaliser
        return total

    @torch.no_grad()
    def _ref_logprobs(self, batch: TrainBatch, rows: torch.Tensor) -> torch.Tensor:
        """``[b, W - 1]`` float32 logprobs of the frozen reference model (eval mode: no dropout) at the rows'
        response tokens (0 elsewhere), packed like the policy's."""
        packed = PackedRows.build(batch.input_ids, batch.attention_mask, rows, self.device)
        mask = batch.response_mask[rows, : packed.max_len - 1].to(self.device)
        return packed_pass(self.ref_model, packed, mask, self.algo.temperature, self.config.logits_chunk).logprobs

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
        return host_weights(self, dtype)

    def capture_weights(self, dtype: torch.dtype | None = torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
        """What ``named_weights`` carries as private copies on the parameters' device, the part of publishing a
        step waits for (``learner.weight_capture.capture_weights``: ZeRO-3 gathers a bucket at a time and only
        rank 0 keeps a copy; other ranks get ``[]``)."""
        return capture_weights(self, dtype)

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

    # ---- checkpoints (learner.checkpoint.engine) --------------------------------------------------
    def save_checkpoint(self, request: CheckpointRequest) -> Path | Future:
        """Commit ``{request.root}/global_step_{step}`` (a ``Future`` of it with ``request.saver``: async save);
        see ``learner.checkpoint.engine.save_checkpoint``."""
        return ckpt_engine.save_checkpoint(self, request)

    def load_checkpoint(self, path: Path, fingerprint: str = "", force: bool = False) -> ckpt.CheckpointMetadata:
        """Restore from ``path``; see ``learner.checkpoint.engine.load_checkpoint``."""
        return ckpt_engine.load_checkpoint(self, path, fingerprint, force)


def _local_device() -> torch.device:
    """The device this rank trains on (DeepSpeed's choice): ``cuda:LOCAL_RANK`` where CUDA is, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
