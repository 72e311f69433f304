"""The DeepSpeed learner engine's configuration (``learner.engine``): model, optimiser, ZeRO stage, micro-batches
(row counts or token budgets), packed attention and the LM head's slices. The RL algorithm's knobs are in
``learner.config``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from gyre.utils.model_source import localize_model_data


DEFAULT_MICRO_BATCH_ROWS = 8
"""Rows per micro-batch when neither ``micro_batch_size`` nor ``micro_batch_tokens`` is set."""


class LearnerConfig(BaseModel):
    """Model, optimiser and DeepSpeed settings of the learner engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    """Path of a Hugging Face model folder (config + safetensors) to start from. A recipe's
    ``model: org/name`` arrives here already resolved to a folder of the HF cache (``utils.model_source``)."""

    model_id: str | None = None
    """The Hub id ``model`` was resolved from (set by the recipe loader); a node without the folder fetches
    ``model_revision`` of it into its own HF cache."""

    model_revision: str | None = None
    """The commit of ``model_id`` the driver resolved."""

    lr: float = Field(1e-6, gt=0.0)
    """AdamW learning rate (constant; no schedule yet). With ``bf16`` the published weights are the
    fp32 master weights rounded to bf16 (relative step 2**-8), so an update of ``lr`` per element
    shows in them only once it accumulates past that."""

    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW decoupled weight decay (applied to every parameter)."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW ``(beta1, beta2)``, each in ``[0, 1)``."""

    adam_eps: float = Field(1e-8, gt=0.0)
    """AdamW epsilon added to the second-moment root."""

    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage: 0 plain data parallel, 1 optimizer states, 2 + gradients, 3 + parameters
    partitioned across ranks."""

    dtype: Literal["bf16", "fp32"] = "bf16"
    """Parameter/activation dtype. With ``bf16`` DeepSpeed keeps fp32 master weights and optimizer
    states; with ``fp32`` everything is fp32."""

    micro_batch_size: int | None = Field(None, ge=1)
    """Rows per forward/backward: each rank's rows are split into ``ceil(rows / micro_batch_size)`` consecutive
    micro-batches whose gradients are accumulated before one optimizer step. ``None``: 8 rows
    (``DEFAULT_MICRO_BATCH_ROWS``), unless ``micro_batch_tokens`` is set; setting both is refused (they would
    disagree on what a micro-batch is)."""

    micro_batch_tokens: int | None = Field(None, ge=1)
    """Token budget of a micro-batch (verl's ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``): the most real
    (prompt + response) tokens one forward/backward packs, per rank. A mini-batch's rows are first spread over
    the data-parallel ranks balanced by token count (Karmarkar–Karp largest differencing, as verl), then each
    rank's rows are packed, longest first, into as few micro-batches under the budget as first-fit finds; every
    rank runs the same number of micro-batches (a rank with fewer splits its fullest ones). The loss does not
    depend on the split: every micro-batch is normalised by its whole mini-batch (``loss_agg_mode``). A row longer
    than the budget is refused (at recipe load from ``rollout.sampling`` limits, and at the step naming the row).
    ``None``: ``micro_batch_size`` rows per micro-batch. ``learner.micro_batches``."""

    attn_kernel: Literal["auto", "varlen", "per_row"] = "auto"
    """Attention over a packed micro-batch (rows concatenated into one sequence, ``position_ids`` restarting per
    row, no padding; ``learner.packing``). ``varlen``: PyTorch's variable-length FlashAttention
    (``torch.nn.attention.varlen.varlen_attn``; CUDA, bf16/fp16, compute capability >= 8.0), no extra install;
    ``per_row``: ``scaled_dot_product_attention`` causal over each row's span in turn (any device, any dtype);
    ``auto``: ``varlen`` where it runs, else ``per_row``. Either way no token attends across rows."""

    logits_chunk: int = Field(1024, ge=1)
    """Tokens per slice of the LM head in the logprob / entropy computation (``learner.algo.logprobs
    .chunked_token_stats``): the ``[tokens, vocab]`` float32 logits exist one slice at a time in forward and are
    recomputed slice by slice in backward, so the head's peak memory is ``logits_chunk * vocab * 4`` bytes
    whatever the micro-batch's length. Only the response tokens' logits are computed."""

    batch_split: Literal["shard", "replicate"] = "shard"
    """With more than one data-parallel rank: ``shard`` trains each rank on its own contiguous ``B / world``
    rows of the batch (data parallelism; ``B`` must be a multiple of the world size, so every rank runs the
    same number of micro-batches and collectives); ``replicate`` feeds every rank the whole batch, so the
    ranks compute identical gradients (ZeRO's memory partitioning only; bit-identical to one rank)."""

    grad_clip: float = Field(1.0, gt=0.0)
    """Global gradient 2-norm clipping threshold (DeepSpeed ``gradient_clipping``)."""

    gradient_checkpointing: bool = False
    """Recompute activations in backward (HF non-reentrant checkpointing) to save memory."""

    seed: int = 0
    """Seed for torch's RNG before the model is loaded."""

    offload_optimizer: Literal["none", "cpu"] = "none"
    """ZeRO-Offload: keep optimizer states (and run the update) in host memory (``cpu``); needs ZeRO >= 1.
    Frees accelerator memory at the cost of step time; on a CPU-only host it changes little."""

    log_comm_time: bool = False
    """Time every DeepSpeed collective (its comms logger, ``prof_all``) and report ``comm_s`` per step. Off by
    default: the logger synchronises the device after every collective, which removes the overlap of
    communication with the backward pass; turn it on to profile, not to train."""

    @model_validator(mode="before")
    @classmethod
    def _localize_model(cls, data: Any, info: ValidationInfo) -> Any:
        return localize_model_data(data, info)

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> "LearnerConfig":
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError(f"offload_optimizer={self.offload_optimizer!r} needs zero_stage >= 1 (got 0): "
                             "ZeRO-Offload partitions the optimizer states it moves")
        return self

    @property
    def rows_per_micro_batch(self) -> int:
        """``micro_batch_size``, or ``DEFAULT_MICRO_BATCH_ROWS`` when it is unset (what a row-count micro-batch holds;
        unused with ``micro_batch_tokens``)."""
        return self.micro_batch_size or DEFAULT_MICRO_BATCH_ROWS

    @model_validator(mode="after")
    def _one_micro_batch_rule(self) -> "LearnerConfig":
        if self.micro_batch_tokens is not None and self.micro_batch_size is not None:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) and micro_batch_tokens ({self.micro_batch_tokens}) are "
                "both set: a micro-batch is either a row count or a token budget; drop micro_batch_size to pack "
                "rows under the token budget (verl's use_dynamic_bsz), or micro_batch_tokens for fixed row counts")
        return self

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas {betas} must each lie in [0, 1)")
        return betas
