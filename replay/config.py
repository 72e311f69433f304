"""Replay service configuration."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ReplayConfig(BaseModel):
    """How replay stores, gates and hands out trajectories."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_staleness: int = Field(2, ge=0)
    """Largest policy lag allowed: a group whose oldest token came from version ``v`` is only handed
    to a learner at version ``L`` if ``L - v <= max_staleness``. Older groups are dropped."""

    capacity_groups: int = Field(4096, ge=1)
    """Most groups held at once; inserts beyond it evict the oldest ready group (FIFO)."""

    max_batch_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    """Largest Arrow IPC payload accepted in one insert (bytes)."""

    lease_ttl_s: float = Field(600.0, gt=0)
    """Seconds before an unacknowledged sample lease returns its groups to the pool."""

    prompt_lease_ttl_s: float = Field(300.0, gt=0)
    """Seconds before an uncompleted prompt lease is re-issued to another rollout."""

    num_prompts: int | None = Field(None, ge=1)
    """Size of the prompt stream; ``None`` means unbounded."""
