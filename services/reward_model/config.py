"""The reward-model service's recipe section (``reward_model:``), importable without gRPC."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RewardServiceConfig(BaseModel):
    """The reward-model service (``reward_model:`` in a recipe): batching and memory. It runs when any task's
    reward names a ``model``; its resources are ``placement.reward_model``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: int = Field(16, ge=1)
    """Responses per forward pass (classifier) or per ``generate`` (judge)."""
    max_wait_ms: float = Field(20.0, ge=0)
    """How long the batcher waits for more requests after the first before scoring (milliseconds)."""
    max_models: int = Field(2, ge=1)
    """Reward models kept loaded at once (a swap to a new revision loads it beside the old one)."""
    max_items: int = Field(4096, ge=1)
    """Most responses one request may carry (a larger one is refused with INVALID_ARGUMENT)."""
