"""Learner loop: lease a batch from replay → GRPO/TIS step → publish the new policy version → ack.

Pure logic over three collaborators: the DeepSpeed ``LearnerEngine``, a ``ReplaySource`` (the gRPC
client in production) and the ``WeightPublisher`` behind ``WeightService``. No grpc import.
"""

from __future__ import annotations

import time
from typing import Protocol

import pyarrow as pa
import structlog
from pydantic import BaseModel, ConfigDict, Field

from learner.batch import build_train_batch
from learner.config import AlgorithmConfig, LearnerConfig
from learner.publisher import WeightPublisher

log = structlog.get_logger("learner")


class LearnerLoopConfig(BaseModel):
    """The learner service: its DeepSpeed engine, its algorithm, and how much it trains."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: LearnerConfig
    algorithm: AlgorithmConfig = AlgorithmConfig()
    num_steps: int = Field(40, ge=1)
    """Optimizer steps (= policy versions published after the initial one)."""
    groups_per_step: int = Field(8, ge=1)
    """Whole GRPO groups per optimizer step (batch = groups_per_step × group_size sequences)."""
    sample_timeout_s: float = Field(1800.0, gt=0)
    """Seconds to wait for a batch before the run fails with a clear error (rollouts dead or gated)."""


class ReplaySource(Protocol):
    def sample(self, num_groups: int, learner_version: int, timeout_s: float,
               consumer: str = "") -> tuple[str, pa.Table] | None: ...
    def ack(self, lease_ids: list[str]) -> int: ...


class NoDataError(TimeoutError):
    """Replay handed out no batch within ``sample_timeout_s``."""


class LearnerLoop:
    """Runs optimizer steps; each one publishes policy version ``step`` (the initial weights are 0).

    Args:
        engine: ``learner.engine.LearnerEngine`` (or a test double with ``train_step``,
            ``named_weights``, ``version``).
        replay: where batches come from and are acknowledged.
        publisher: receives every new version's named tensors.
        pad_token_id: tokenizer pad id for right-padding.
    """

    def __init__(self, config: LearnerLoopConfig, engine, replay: ReplaySource, publisher: WeightPublisher,
                 pad_token_id: int) -> None:
        self.config, self.engine, self.replay, self.publisher = config, engine, replay, publisher
        self.pad_token_id = pad_token_id

    def publish_current(self) -> float:
        """Publish the engine's current weights under its current version; returns seconds."""
        t0 = time.monotonic()
        self.publisher.publish(self.engine.version, self.engine.named_weights())
        return time.monotonic() - t0

    def step(self) -> dict:
        """One optimizer step; returns its metrics row (plain floats/ints).

        Raises:
            NoDataError: no batch within ``sample_timeout_s`` seconds.
        """
        t0 = time.monotonic()
        lease_id, table = self._lease_batch()
        t_sampled = time.monotonic()
        batch = build_train_batch(table, self.pad_token_id, self.engine.version, self.config.algorithm)
        metrics = self.engine.train_step(batch)
        t_trained = time.monotonic()  # train_step advanced engine.version by one
        publish_s = self.publish_current()
        # Issue 2 acks right after the step; acking only after a committed checkpoint comes with
        # the checkpoint work (DESIGN.md §2), so a learner crash here re-trains at most one batch.
        self.replay.ack([lease_id])
        return {
            **metrics,
            "step": self.engine.version, "version": self.engine.version, "groups": self.config.groups_per_step,
            "trajectories": table.num_rows, "sample_wait_s": t_sampled - t0, "train_s": t_trained - t_sampled,
            "publish_s": publish_s, "step_s": time.monotonic() - t0, "time": time.time(),
        }

    def _lease_batch(self) -> tuple[str, pa.Table]:
        deadline = time.monotonic() + self.config.sample_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoDataError(
                    f"no batch of {self.config.groups_per_step} groups within {self.config.sample_timeout_s}s "
                    f"at learner version {self.engine.version}; are the rollouts alive?")
            try:
                got = self.replay.sample(self.config.groups_per_step, self.engine.version,
                                         timeout_s=min(remaining, 10.0), consumer="learner")
            except ConnectionError as exc:
                log.warning("replay_unreachable", error=str(exc)[:200])
                time.sleep(1.0)
                continue
            if got is not None:
                return got
