"""Rollout worker: lease prompts → generate a GRPO group with vLLM → score → stream to replay.

Pure asyncio + the engine; the replay connection is any object with the ``ReplaySink`` methods
(the gRPC client in production, a fake in unit tests), so this module imports no grpc.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass, field
from typing import Protocol

import pyarrow as pa
import structlog
from pydantic import BaseModel, ConfigDict, Field

from proto.trajectory import Trajectory, make_ids, to_table
from rollout.config import EngineConfig, SamplingConfig
from rollout.tasks import REWARD_FN_VERSION, TaskSource

log = structlog.get_logger("rollout")


class RolloutConfig(BaseModel):
    """One rollout service: its engine, sampling, group size and flow control."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_workers: int = Field(1, ge=1)
    """Rollout services started by the controller."""
    group_size: int = Field(4, ge=1)
    """Samples per prompt (``n``, the GRPO group)."""
    groups_in_flight: int = Field(4, ge=1)
    """Prompts generated concurrently by one rollout (vLLM batches them)."""
    max_ready_groups: int = Field(16, ge=1)
    """Backpressure: no new prompt is leased while replay holds at least this many ready groups."""
    engine: EngineConfig
    sampling: SamplingConfig = SamplingConfig()
    eval_max_new_tokens: int = Field(16, ge=1)
    """Greedy token budget for held-out evaluation."""
    retry_backoff_s: float = Field(1.0, gt=0)
    """First wait (seconds) before re-sending a batch replay did not acknowledge; doubles up to 30 s."""


class ReplaySink(Protocol):
    def lease_prompts(self, consumer: str, count: int, ttl_s: float = 0.0) -> list[tuple[int, int]]: ...
    def insert(self, table: pa.Table): ...
    def info(self): ...


@dataclass
class RolloutStats:
    groups: int = 0
    trajectories: int = 0
    tokens: int = 0
    reward_sum: float = 0.0
    started_at: float = field(default_factory=time.monotonic)
    weight_updates: int = 0
    last_update_s: float = 0.0
    insert_retries: int = 0

    def as_dict(self, version: int) -> dict:
        elapsed = max(time.monotonic() - self.started_at, 1e-9)
        return {"version": version, "groups": self.groups, "trajectories": self.trajectories,
                "tokens": self.tokens, "tokens_per_s": self.tokens / elapsed,
                "reward_mean": self.reward_sum / max(self.trajectories, 1),
                "weight_updates": self.weight_updates, "last_update_s": self.last_update_s,
                "insert_retries": self.insert_retries}


class RolloutWorker:
    """Generates trajectories for one rollout service.

    Args:
        rollout_id: unique name of this service instance (recorded on every trajectory).
        config, task: what to generate and how.
        engine: a started ``rollout.engine.RolloutEngine`` (or a test double with the same methods).
        replay: the replay connection; its blocking calls run in the default executor.
        tokenizer: HF tokenizer of the policy (chat template for prompts).
        seed: base of the per-request sampling seeds (derived from prompt index and attempt).
    """

    def __init__(self, rollout_id: str, config: RolloutConfig, task: TaskSource, engine, replay: ReplaySink,
                 tokenizer, seed: int = 0) -> None:
        self.rollout_id, self.config, self.task = rollout_id, config, task
        self.engine, self.replay, self.tokenizer, self.seed = engine, replay, tokenizer, seed
        self.stats = RolloutStats()
        self._stopping = asyncio.Event()

    # ---- weights ------------------------------------------------------------------------------
    async def apply_weights(self, version: int, named_tensors) -> None:
        """Apply a policy version in flight (engine: pause, load, reset prefix cache, resume)."""
        if version <= self.engine.version:
            return
        seconds = await self.engine.update_weights(version, named_tensors)
        self.stats.weight_updates += 1
        self.stats.last_update_s = seconds
        log.info("weights_applied", rollout=self.rollout_id, version=version, seconds=round(seconds, 3))

    # ---- generation loop ----------------------------------------------------------------------
    async def run(self) -> None:
        """Generate until ``stop()``; at most ``groups_in_flight`` prompts at once."""
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task] = set()
        while not self._stopping.is_set():
            if len(tasks) < self.config.groups_in_flight:
                try:
                    leases = await self._lease_one(loop)
                except ConnectionError as exc:
                    log.warning("replay_unreachable", rollout=self.rollout_id, error=str(exc)[:200])
                    leases = []
                if leases:
                    tasks.add(asyncio.create_task(self._one_group(*leases[0])))
                    continue
            if tasks:
                done, tasks = await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
            else:
                await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        self._stopping.set()

    async def _lease_one(self, loop) -> list[tuple[int, int]]:
        """One prompt lease, or none while replay already holds ``max_ready_groups`` ready groups."""
        info = await loop.run_in_executor(None, self.replay.info)
        if info.size_groups >= self.config.max_ready_groups:
            return []
        return await loop.run_in_executor(None, self.replay.lease_prompts, self.rollout_id, 1)

    async def _one_group(self, prompt_index: int, attempt: int) -> None:
        problem = self.task.train_problem(prompt_index)
        prompt_ids = self._prompt_ids(problem["question"])
        _, group_id = make_ids(prompt_index, 0, attempt)
        seed = zlib.crc32(f"{self.seed}-{group_id}".encode())
        samples = await self.engine.generate(prompt_ids, self.config.group_size, self.config.sampling,
                                             request_id=f"{group_id}@{self.rollout_id}", seed=seed)
        rows = []
        for i, s in enumerate(samples):
            tid, gid = make_ids(prompt_index, i, attempt)
            rows.append(Trajectory(
                trajectory_id=tid, group_id=gid, prompt_index=prompt_index, sample_index=i, attempt=attempt,
                task=self.task.config.name, prompt_token_ids=prompt_ids, response_token_ids=list(s.token_ids),
                behaviour_logprobs=list(s.logprobs), reward=self.task.score(s.text, problem),
                finish_reason=s.finish_reason, version_span_starts=list(s.version_span_starts),
                version_span_versions=list(s.version_span_versions), reward_fn_version=REWARD_FN_VERSION,
                rollout_id=self.rollout_id, created_at=time.time()))
        await self._insert_with_retry(to_table(rows))
        self.stats.groups += 1
        self.stats.trajectories += len(rows)
        self.stats.tokens += sum(len(r.response_token_ids) for r in rows)
        self.stats.reward_sum += sum(r.reward for r in rows)

    async def _insert_with_retry(self, table: pa.Table) -> None:
        """Re-send until replay acknowledges; ids make a retried batch harmless."""
        loop = asyncio.get_running_loop()
        backoff = self.config.retry_backoff_s
        while True:
            try:
                await loop.run_in_executor(None, self.replay.insert, table)
                return
            except ConnectionError as exc:  # replay down or slow (the gRPC client maps UNAVAILABLE/DEADLINE here)
                self.stats.insert_retries += 1
                log.warning("insert_retry", rollout=self.rollout_id, error=str(exc)[:200], retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    def _prompt_ids(self, question: str) -> list[int]:
        ids = self.tokenizer.apply_chat_template(self.task.messages(question), add_generation_prompt=True,
                                                 tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    # ---- evaluation ---------------------------------------------------------------------------
    async def evaluate(self) -> dict:
        """Greedy accuracy on the task's held-out set with the current weights.

        Returns ``heldout_accuracy`` (fraction of exactly correct answers, in [0, 1]), ``heldout_correct``,
        ``heldout_size``, ``heldout_score_mean`` (mean verifier score, with its partial credit) and ``version``.
        """
        problems = self.task.heldout_problems()
        prompts = [self._prompt_ids(p["question"]) for p in problems]
        samples = await self.engine.generate_greedy(prompts, self.config.eval_max_new_tokens)
        scores = [self.task.score(s.text, p) for s, p in zip(samples, problems)]
        correct = sum(score >= 1.0 for score in scores)  # exact answers; the verifier gives partial credit
        return {"heldout_accuracy": correct / len(problems), "heldout_correct": correct,
                "heldout_size": len(problems), "heldout_score_mean": sum(scores) / len(problems),
                "version": self.engine.version}
