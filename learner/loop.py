"""Learner loop: lease a batch from replay → GRPO/TIS step → publish the new policy version →
every ``save_interval`` steps checkpoint, then ack the leases that checkpoint trained on.

Acking only after the commit (DESIGN.md §2) means a learner crash loses no trajectory: leases not
yet acked expire in replay (``ReplayConfig.lease_ttl_s``) and their groups are sampled again. That TTL
must therefore exceed the time ``save_interval`` steps take, or groups come back while still pending.

Pure logic over three collaborators: the DeepSpeed ``LearnerEngine``, a ``ReplaySource`` (the gRPC
client in production) and the ``WeightPublisher`` behind ``WeightService``. No grpc import.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
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
    save_interval: int = Field(10, ge=1)
    """Checkpoint every this many steps (and always at the end, ``LearnerLoop.checkpoint``); leases are
    acked to replay only after the checkpoint holding their update commits, so replay's
    ``lease_ttl_s`` must exceed the wall time of ``save_interval`` steps plus one save."""
    keep_last_n: int = Field(3, ge=1)
    """Committed checkpoints kept; older ones are deleted after each save."""
    fingerprint: str = ""
    """Task/dataset fingerprint stored in each checkpoint; resuming under another one is refused."""
    resume: str = "auto"
    """``auto``: newest verified checkpoint in the checkpoint dir (cold start, logged, if none);
    ``none``: always start fresh; otherwise the path of a ``global_step_N`` checkpoint."""
    force_resume: bool = False
    """Resume even when the checkpoint's task/dataset fingerprint differs (schema mismatches never)."""


class ReplaySource(Protocol):
    def sample(self, num_groups: int, learner_version: int, timeout_s: float,
               consumer: str = "") -> tuple[str, pa.Table] | None: ...
    def ack(self, lease_ids: list[str]) -> int: ...


class NoDataError(TimeoutError):
    """Replay handed out no batch within ``sample_timeout_s``."""


class StopRequested(SystemExit):
    """SIGTERM arrived: the emergency checkpoint committed (and acked); the process should exit cleanly."""

    def __init__(self) -> None:
        super().__init__(0)


class LearnerLoop:
    """Runs optimizer steps; each one publishes policy version ``step`` (the initial weights are 0).

    Args:
        engine: ``learner.engine.LearnerEngine`` (or a test double with ``train_step``,
            ``named_weights``, ``version``).
        replay: where batches come from and are acknowledged.
        publisher: receives every new version's named tensors.
        pad_token_id: tokenizer pad id for right-padding.
        checkpoint_dir: where ``global_step_N`` checkpoints go; ``None`` keeps every lease pending
            (nothing is acked) until a directory is given.
    """

    def __init__(self, config: LearnerLoopConfig, engine, replay: ReplaySource, publisher: WeightPublisher,
                 pad_token_id: int, checkpoint_dir: Path | None = None) -> None:
        self.config, self.engine, self.replay, self.publisher = config, engine, replay, publisher
        self.pad_token_id = pad_token_id
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.pending_lease_ids: list[str] = []
        """Leases trained on since the last committed checkpoint (not acked yet)."""
        self.acked_lease_count = 0
        self.last_checkpoint: Path | None = None
        self._emergency: int | None = None  # signal number awaiting an emergency checkpoint

    def install_signal_handlers(self) -> dict:
        """SIGUSR1 → checkpoint after the current step and continue; SIGTERM → checkpoint after the
        current step, then ``step`` raises ``StopRequested`` (exit 0). Main thread only; returns the
        previous handlers (``signal.signal(sig, handler)`` each to undo)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread")
        return {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGUSR1, signal.SIGTERM)}

    def _on_signal(self, signum, frame) -> None:
        if self._emergency != signal.SIGTERM:  # a pending SIGTERM is never downgraded
            self._emergency = signum
        log.warning("emergency_checkpoint_requested", signal=signal.Signals(signum).name)

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
        self.pending_lease_ids.append(lease_id)
        save_s = 0.0
        emergency, self._emergency = self._emergency, None
        if self.checkpoint_dir is not None and (emergency or self.engine.step % self.config.save_interval == 0):
            save_s = self.checkpoint()
        if emergency == signal.SIGTERM:
            log.warning("stopping_after_sigterm", step=self.engine.step, checkpoint=str(self.last_checkpoint))
            raise StopRequested()
        return {
            **metrics,
            "step": self.engine.version, "version": self.engine.version, "groups": self.config.groups_per_step,
            "trajectories": table.num_rows, "sample_wait_s": t_sampled - t0, "train_s": t_trained - t_sampled,
            "publish_s": publish_s, "checkpoint_s": save_s,
            "pending_leases": len(self.pending_lease_ids), "step_s": time.monotonic() - t0, "time": time.time(),
        }

    def checkpoint(self) -> float:
        """Commit a checkpoint of the current step (unless one exists already) and then ack every
        pending lease; returns seconds. Raises ``RuntimeError`` without a ``checkpoint_dir``."""
        if self.checkpoint_dir is None:
            raise RuntimeError("LearnerLoop has no checkpoint_dir; cannot checkpoint or ack")
        t0 = time.monotonic()
        if self.last_checkpoint is None or self.last_checkpoint.name != f"global_step_{self.engine.step}":
            self.last_checkpoint = self.engine.save_checkpoint(
                self.checkpoint_dir, pending_lease_ids=self.pending_lease_ids,
                acked_lease_count=self.acked_lease_count, fingerprint=self.config.fingerprint,
                keep_last_n=self.config.keep_last_n)
        if self.pending_lease_ids:
            self.replay.ack(self.pending_lease_ids)
            self.acked_lease_count += len(self.pending_lease_ids)
            self.pending_lease_ids = []
        return time.monotonic() - t0

    def resume(self) -> Path | None:
        """Apply ``config.resume``: load the chosen checkpoint into the engine and ``restore`` from it;
        returns its path, or ``None`` for a cold start. Call before ``publish_current`` so the restored
        version is (re-)published. Raises ``learner.checkpoint.CheckpointError`` when refused."""
        from learner.checkpoint import resolve_resume

        mode = self.config.resume
        path = resolve_resume(mode, self.checkpoint_dir) if self.checkpoint_dir or mode != "auto" else None
        if path is None:
            log.info("cold_start", resume=mode, checkpoint_dir=str(self.checkpoint_dir))
            return None
        meta = self.engine.load_checkpoint(path, fingerprint=self.config.fingerprint, force=self.config.force_resume)
        self.restore(meta)
        self.last_checkpoint = path
        log.info("resumed", path=str(path), step=meta.step, version=meta.policy_version,
                 pending_leases=len(meta.pending_lease_ids), acked_leases=self.acked_lease_count)
        return path

    def restore(self, meta) -> None:
        """After ``engine.load_checkpoint``: ack the leases that checkpoint committed but may not have
        acked before the crash. Already-acked or expired ids are logged and skipped (recovery path)."""
        self.acked_lease_count = meta.acked_lease_count
        for lease_id in meta.pending_lease_ids:
            try:
                self.replay.ack([lease_id])
                self.acked_lease_count += 1
            except Exception as exc:  # recovery path: unknown (acked/expired: UnknownLeaseError in-process,
                # NOT_FOUND over gRPC) or replay unreachable; an unacked lease expires back to the pool
                log.warning("resume_ack_skipped", lease_id=lease_id, error=f"{type(exc).__name__}: {str(exc)[:200]}")

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
