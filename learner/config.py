"""Learner configuration: the RL algorithm's knobs and the DeepSpeed engine's."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class AlgorithmConfig(BaseModel):
    """GRPO advantages + decoupled PPO loss with truncated importance sampling (see ``learner.algorithms``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clip_eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """PPO clip range below 1: the ratio ``pi/pi_prox`` is clipped at ``1 - clip_eps_low``."""

    clip_eps_high: float = Field(0.2, ge=0.0)
    """PPO clip range above 1: the ratio is clipped at ``1 + clip_eps_high`` (DAPO's clip-higher
    sets this above ``clip_eps_low``, e.g. 0.28)."""

    tis_cap: float = Field(2.0, ge=1.0)
    """Truncation ``C`` of the token-wise importance weight ``min(pi_prox/pi_behaviour, C)``
    (TIS, Yao et al. 2025). ``>= 1`` so that on-policy tokens (weight 1) are never truncated."""

    adv_eps: float = Field(1e-6, gt=0.0)
    """Added to the group reward std before dividing (GRPO); keeps equal-reward groups at 0 advantage."""

    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature the rollout used. vLLM reports ``processed_logprobs`` (after temperature),
    so the learner divides its logits by the same value before the log-softmax. The rollout must not
    use top-k/top-p, which would renormalise the behaviour distribution."""


class LearnerConfig(BaseModel):
    """Model, optimiser and DeepSpeed settings of the learner engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    """Path of a Hugging Face model folder (config + safetensors) to start from."""

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

    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward; a batch is split into ``ceil(B / micro_batch_size)``
    micro-batches whose gradients are accumulated before one optimizer step."""

    grad_clip: float = Field(1.0, gt=0.0)
    """Global gradient 2-norm clipping threshold (DeepSpeed ``gradient_clipping``)."""

    gradient_checkpointing: bool = False
    """Recompute activations in backward (HF non-reentrant checkpointing) to save memory."""

    seed: int = 0
    """Seed for torch's RNG before the model is loaded."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas {betas} must each lie in [0, 1)")
        return betas
