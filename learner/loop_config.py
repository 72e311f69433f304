"""The learner loop's config: what it trains, how often it checkpoints, where copies go, how it resumes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gyre.learner.checkpoint.archive import ArchiveConfig
from gyre.learner.config import AlgorithmConfig, LearnerConfig
from gyre.learner.algo.objective_check import check_objectives
from gyre.learner.checkpoint.spike import SpikeSaveConfig
from gyre.proto.lockstep import LockstepConfig


class SaveRange(BaseModel):
    """From optimizer step ``from_step`` on, checkpoint every ``interval`` steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    from_step: int = Field(ge=0)
    """First optimizer step this range applies to."""
    interval: int = Field(ge=1)
    """Checkpoint every this many steps within the range."""


class LearnerLoopConfig(BaseModel):
    """The learner service: its DeepSpeed engine, its algorithm, and how much it trains."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: LearnerConfig
    """The DeepSpeed engine: ZeRO stage, dtype, micro-batch size, optimizer, gradient checkpointing."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """The RL objective: advantage estimator, policy ratio, importance correction, clipping, KL, loss
    aggregation, PPO epochs and mini-batches."""
    num_steps: int = Field(40, ge=1)
    """Optimizer steps (= policy versions published after the initial one)."""
    groups_per_step: int = Field(8, ge=1)
    """Whole GRPO groups per optimizer step (batch = groups_per_step × group_size sequences)."""
    sample_timeout_s: float = Field(1800.0, gt=0)
    """Seconds to wait for a batch before the run fails with a clear error (rollouts dead or gated)."""
    save_interval: int = Field(10, ge=1)
    """Checkpoint every this many steps (and always at the end, ``LearnerLoop.checkpoint``); leases are
    acked to replay only after the checkpoint holding their update commits, so replay's
    ``lease_ttl_s`` must exceed the wall time of ``save_interval`` steps plus one save."""
    save_schedule: list[SaveRange] = []
    """Adaptive save interval by step range (the seeds' schedule), e.g. ``[{from_step: 0, interval: 5},
    {from_step: 100, interval: 50}]``: at step ``s`` the range with the largest ``from_step <= s`` applies
    and a checkpoint is due when ``s % interval == 0``. Empty: ``save_interval`` everywhere."""
    spike_save: SpikeSaveConfig = SpikeSaveConfig()
    """Loss-spike checkpoints (``learner.checkpoint.spike``): after a step whose ``loss`` or ``grad_norm`` lies above
    ``median + factor * 1.4826 * MAD`` of its last ``window`` steps, a checkpoint is due every
    ``max(1, interval // interval_divisor)`` steps for ``hold_steps`` steps. Off by default."""
    async_save: bool = False
    """Write checkpoints in the background (``learner.checkpoint.async_save``), at any world size: training waits
    only for an in-memory copy of each rank's shard; leases are acked when the background commit (rank 0, once
    every rank's shard is on disk) finishes. Costs host memory for one copy of each rank's state while in flight."""
    mirror_dir: str | None = None
    """Double-write: every committed checkpoint is copied here (ideally another disk) with the same commit
    protocol before its leases are acked; resume falls back to (and repairs from) it when the primary
    copy is missing or corrupt (``learner.mirror``)."""
    archive: ArchiveConfig | None = None
    """Object-storage tier (``learner.archive``: any fsspec URL, e.g. ``s3://bucket/run``; optional
    AES-256-GCM). Each checkpoint is uploaded in the background after its leases are acked; resume uses it
    when no local copy verifies."""
    keep_last_n: int = Field(3, ge=1)
    """Committed checkpoints kept; older ones are deleted after each save."""
    fingerprint: str = ""
    """Task/dataset fingerprint stored in each checkpoint; resuming under another one is refused."""
    resume: str = "auto"
    """``auto``: newest verified checkpoint in the checkpoint dir (cold start, logged, if none);
    ``none``: always start fresh; otherwise the path of a ``global_step_N`` checkpoint."""
    force_resume: bool = False
    """Resume even when the checkpoint's task/dataset fingerprint differs (schema mismatches never)."""
    lockstep: LockstepConfig | None = None
    """Deterministic mode (set by the recipe's ``determinism: lockstep``): step s leases exactly the groups of
    prompts ``[s·P, (s+1)·P)`` in order, and every published version is also written to the version store."""


    @field_validator("save_schedule")
    @classmethod
    def _schedule_sorted(cls, schedule: list[SaveRange]) -> list[SaveRange]:
        starts = [r.from_step for r in schedule]
        if starts != sorted(set(starts)):
            raise ValueError(f"save_schedule from_step values {starts} must be strictly increasing")
        return schedule

    @field_validator("algorithm")
    @classmethod
    def _check_objectives(cls, algorithm: AlgorithmConfig) -> AlgorithmConfig:
        check_objectives(algorithm)  # a custom advantage / loss: imported and run on a synthetic batch
        return algorithm

    def save_interval_at(self, step: int) -> int:
        """The checkpoint interval in force at optimizer step ``step``."""
        interval = self.save_interval
        for r in self.save_schedule:
            if r.from_step <= step:
                interval = r.interval
        return interval
