"""Rollout worker: lease prompts → generate a GRPO group with vLLM → score → stream to replay.

Pure asyncio + the engine; the replay connection is any object with the ``ReplaySink`` methods
(the gRPC client in production, a fake in unit tests), so this module imports no grpc.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import Coroutine
from typing import Any, Protocol

import pyarrow as pa
import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from gyre.faults import fault_point
from gyre.utils.retry import doubling
from gyre.proto.timeline import SHARED, is_new, label
from gyre.proto.trajectory import Trajectory, make_ids, to_table
from gyre.rollout.config import RolloutConfig
from gyre.rollout.agents.episode_eval import evaluate_episodes
from gyre.rollout.agents.episode_runners import episode_runner
from gyre.rollout.evaluation import EvalConfig, EvalResult, evaluate
from gyre.rollout.spool import Spool, SpoolFlusher
from gyre.rollout.stats import RolloutStats
from gyre.rollout.rewards.base import Group
from gyre.rollout.rewards.scoring import score_groups
from gyre.rollout.tasks import TaskSource
from gyre.rollout.versions import VersionSource, version_source

log = structlog.get_logger("rollout")
LEASE_RETRY_S = 0.5
"""Seconds before a rollout that got fewer leases than it asked for asks again (sooner when a group finishes)."""
INSERT_BACKOFF_CAP_S = 30.0
"""Longest wait (seconds) before re-sending a batch replay did not acknowledge (``retry_backoff_s`` is the first)."""


class ReplaySink(Protocol):
    def lease_prompts(self, consumer: str, count: int, ttl_s: float = 0.0, below: int = 0,
                      max_ready: int = 0, policy_version: int | None = None) -> list[tuple[int, int]]: ...
    def insert(self, table: pa.Table): ...
    def info(self): ...


class RolloutWorker:
    """Generates trajectories for one rollout service.

    Args:
        rollout_id: unique name of this service instance (recorded on every trajectory).
        config, task: what to generate and how.
        engine: a started ``rollout.engine.RolloutEngine`` (or a test double with the same methods).
        replay: the replay connection; its blocking calls run in the default executor.
        tokenizer: HF tokenizer of the policy (chat template for prompts).
        seed: base of the per-request sampling seeds (derived from prompt index and attempt).
        versions: where each group's policy version comes from (``rollout.versions``; ``engine`` is bound to
            it); None: ``version_source(config)``.
    """

    def __init__(self, rollout_id: str, config: RolloutConfig, task: TaskSource, engine, replay: ReplaySink,
                 tokenizer, seed: int = 0, versions: VersionSource | None = None) -> None:
        self.rollout_id, self.config, self.task = rollout_id, config, task
        self.engine, self.replay, self.tokenizer, self.seed = engine, replay, tokenizer, seed
        self.stats = RolloutStats(prompts_too_long=task.too_long())
        self._stopping = asyncio.Event()  # the newest run()'s stop signal (each run() makes its own)
        self._running = False  # a run() is generating (its loop started and has not finished)
        self.spool = (Spool(config.spool_dir, config.spool_max_bytes, config.spool_max_groups)
                      if config.spool_dir else None)
        self.stats.spool = self.spool
        self.flusher = SpoolFlusher(self.spool, self._insert_with_retry) if self.spool else None
        self.versions = (versions if versions is not None else version_source(config)).bind(engine)
        """Where each group's policy version comes from (``rollout.versions``)."""
        self.stats.other_weight_loads = self.versions.load_s  # lockstep's gate loads weights itself
        self.timeline = SHARED
        """Timeline (``proto.timeline``) of the weights the engine serves: ``SHARED`` for the initial ones."""
        self._tasks: set[asyncio.Task] = set()  # groups being generated (run's tasks)
        self._steady = asyncio.Event()  # cleared while the timeline switches: no group starts meanwhile
        self._steady.set()
        self._flush_wakeup = asyncio.Event()
        self._puts: set[asyncio.Future] = set()
        self._gate = (-1, 0)  # (policy version, groups started with it) for max_groups_per_version
        self._lease_again_at = 0.0
        """Event-loop time before which a rollout with groups in flight does not ask replay for more (it got fewer
        than it asked for: the work budget is spent); a finished group clears it."""
        self._new_version = asyncio.Event()
        self.episodes = episode_runner(config, tokenizer)
        """Multi-turn episodes when the recipe sets ``rollout.environment`` (``rollout.agents.agent_group``) or
        ``rollout.verifiers`` (``rollout.agents.verifiers_env``)."""
        self.stats.env_threads = getattr(self.episodes, "threads", None)  # rollout.environment's blocking calls

    # ---- weights ------------------------------------------------------------------------------
    async def apply_weights(self, version: int, named_tensors, timeline: int = SHARED) -> None:
        """Apply policy ``version`` of ``timeline`` in flight (engine: pause, load, reset prefix cache, resume)
        when it is new to the engine (``proto.timeline.is_new``), else ignore it.

        A version of another timeline than the engine's (the learner resumed from an older checkpoint) is
        applied whatever its number: first the groups in generation are cancelled, since their tokens came
        from weights no learner will continue (their prompt leases expire and are re-issued), and no group
        starts until the new weights are in. Raises what ``engine.update_weights`` raises. Only noted when
        ``self.versions`` does not use streamed weights (lockstep: exact versions come from the version store).
        """
        if not self.versions.offer(version):
            return
        if not is_new(version, timeline, self.engine.version, self.timeline):
            return
        fault_point("rollout.apply_weights")
        old, switch = self.timeline, timeline != self.timeline
        if switch:
            self._steady.clear()
        try:
            if switch and old != SHARED:  # SHARED weights (the initial ones) are every timeline's
                await self._cancel_groups()
            # before the load: a group finishing meanwhile labels its newest span with the new timeline, which
            # is right for the new version and harmless for version 0 (``label``: SHARED)
            self.timeline = timeline
            rewind = {"rewind": True} if version <= self.engine.version else {}
            seconds = await self.engine.update_weights(version, named_tensors, **rewind)
        except BaseException:
            self.timeline = old
            raise
        finally:
            self._steady.set()
        if switch:
            self.stats.timeline_switches += 1
            log.warning("weights_timeline_switched", rollout=self.rollout_id, version=version, timeline=timeline,
                        from_timeline=old)
        self.stats.weight_updates += 1
        self.stats.last_update_s = seconds
        self.stats.weight_apply_s += seconds
        self._new_version.set()  # wakes a generation loop waiting at the version gate
        log.info("weights_applied", rollout=self.rollout_id, version=version, seconds=round(seconds, 3))

    def serves(self, version: int, timeline: int) -> bool:
        """Whether the engine serves ``version`` of ``timeline`` or a newer version of that timeline
        (``VersionSource.serves``)."""
        return self.versions.serves(version, timeline, self.timeline)

    async def _cancel_groups(self) -> None:
        """Cancel every group in generation and wait for them (a generated group's delivery still finishes)."""
        doomed = [t for t in self._tasks if not t.done()]
        for t in doomed:
            t.cancel()
        await asyncio.gather(*doomed, return_exceptions=True)
        self.stats.groups_dropped_on_switch += len(doomed)

    # ---- generation loop ----------------------------------------------------------------------
    def run(self) -> Coroutine[Any, Any, None]:
        """The generation loop, as a coroutine to await or wrap in a task: generate until ``stop()``; at most
        ``groups_in_flight`` prompts at once, and with ``max_groups_per_version`` at most that many groups started
        per policy version (then it waits for ``apply_weights`` of a newer one).

        Each call gets its own stop signal, made here, when ``run()`` is called (not when the coroutine first
        runs): a ``stop()`` before this call does not end it, a ``stop()`` after it does, even one that comes
        before the coroutine starts. So a stopped worker generates again with another ``run()`` (the actor's
        ``start`` after ``pause``), and ``create_task(worker.run())`` followed at once by ``stop()`` stops it.

        With a spool: first ``recover()`` it and start the flusher (which delivers what a previous
        incarnation left, oldest first); on stop, groups still in the spool stay there for the next start
        (or ``self.flusher.drain``). Raises whatever the flusher raised (not a retryable replay error), and
        ``RuntimeError`` when the previous ``run()`` has not finished (await it after ``stop()`` first).
        """
        if self._running:
            raise RuntimeError(f"rollout {self.rollout_id}: run() called while the previous run() is still "
                               "generating; stop() it and await it first")
        self._stopping = asyncio.Event()
        return self._generate(self._stopping)

    async def _generate(self, stopping: asyncio.Event) -> None:
        """``run()``'s loop, until ``stopping`` is set."""
        if self._running:  # two run() coroutines made before either started: the second one refuses
            raise RuntimeError(f"rollout {self.rollout_id}: another run() is generating")
        self._running = True
        try:
            await self._loop(stopping)
        finally:
            self._running = False

    async def _loop(self, stopping: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        tasks = self._tasks
        flusher = await self._start_spool(loop)
        try:
            while not stopping.is_set():
                if flusher is not None and flusher.done():
                    flusher.result()  # it only ends by raising
                gate_open = self._gate_open()
                if not gate_open:
                    self.stats.gate_waits += 1
                free = self._room(len(tasks))
                if free and gate_open and (not tasks or loop.time() >= self._lease_again_at):
                    try:
                        leases = await self._lease(loop, free)
                    except ConnectionError as exc:
                        log.warning("replay_unreachable", rollout=self.rollout_id, error=str(exc)[:200])
                        leases = []
                    for lease in leases:
                        self._count_group(self.engine.version)
                        tasks.add(asyncio.create_task(self._one_group(*lease)))
                    self.stats.groups_in_flight = len(tasks)
                    if len(leases) < free:  # the budget is spent (or the spool full): ask again after a while
                        self._lease_again_at = loop.time() + LEASE_RETRY_S
                    if leases:
                        continue
                if tasks:
                    done, _ = await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                    tasks.difference_update(done)
                    if done:
                        self._lease_again_at = 0.0
                    self.stats.groups_in_flight = len(tasks)
                    for t in done:
                        if not t.cancelled():  # cancelled by a timeline switch (``apply_weights``)
                            t.result()
                elif not gate_open:  # wait for the next policy version (or re-check after 0.2 s)
                    self._new_version.clear()
                    if not self._gate_open():
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._new_version.wait(), 0.2)
                else:
                    await asyncio.sleep(0.2)
        finally:  # also when run() itself is cancelled or fails: no group task or flusher outlives it
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            tasks.clear()
            self.stats.groups_in_flight = 0
            await asyncio.gather(*self._puts, return_exceptions=True)  # a cancelled group's put still finishes
            if flusher is not None:
                flusher.cancel()
                await asyncio.gather(flusher, return_exceptions=True)
            if self.episodes is not None:  # a verifiers runner's servers start again with the next group
                await self.episodes.close()

    def stop(self) -> None:
        """End the newest ``run()`` (called, even if not started yet): it leases no more prompts, cancels the
        groups in generation (their prompt leases expire and are re-issued) and returns. No-op without one."""
        self._stopping.set()

    def _gate_open(self) -> bool:
        """Whether ``max_groups_per_version`` lets another group start with the engine's current version."""
        if not self._steady.is_set():  # a timeline switch is cancelling groups: none starts on the dead weights
            return False
        return self._gate_room() > 0

    def _gate_room(self) -> float:
        """Groups ``max_groups_per_version`` still lets start with the engine's current version (inf: no gate)."""
        limit = self.config.max_groups_per_version
        if limit is None:
            return math.inf
        version, started = self._gate
        return limit - (started if version == self.engine.version else 0)

    def _count_group(self, version: int) -> None:
        """Count a group started with policy ``version`` against the version gate."""
        current, started = self._gate
        self._gate = (version, started + 1 if version == current else 1)

    def swap_reward(self, config) -> dict[str, str]:
        """Swap reward functions without restarting (``TaskSource.swap_reward``): validated first, an invalid
        config raises and the old rewards keep scoring; groups started afterwards use the new ones.
        Returns ``{task: reward_fn_version}`` now in force."""
        versions = self.task.swap_reward(config)
        log.info("reward_swapped", rollout=self.rollout_id, versions=versions)
        return versions

    def _room(self, in_flight: int) -> int:
        """Groups this rollout may start now: free ``groups_in_flight`` slots, within the version gate."""
        return max(0, int(min(self.config.groups_in_flight - in_flight, self._gate_room())))

    async def _lease(self, loop, count: int) -> list[tuple[int, int]]:
        """Up to ``count`` prompt leases in one ``LeasePrompts`` call: replay grants fewer or none when the fleet's
        work budget is spent (``ReplayConfig.work_budget``) or it holds ``max_ready_groups`` ready groups; none
        while the spool is full. Raises ``ConnectionError`` when replay is unreachable: prompt leases come from
        replay, so an outage stops new prompts; groups already leased still finish into the spool."""
        if self.spool is not None and self.spool.full():
            return []
        bound = self.versions.lease_args()  # lockstep: only prompts whose exact version is already published
        if bound is None:
            return []
        lease = functools.partial(self.replay.lease_prompts, self.rollout_id, count, *bound,
                                  max_ready=self.config.max_ready_groups, policy_version=self.versions.served())
        return await loop.run_in_executor(None, lease)

    async def _one_group(self, prompt_index: int, attempt: int) -> None:
        problem = self.task.problem(prompt_index)
        reward_fn = self.task.reward_for(problem.task)  # bound at group start: a reward swap applies to later groups
        prompt_ids = self._prompt_ids(problem)
        _, group_id = make_ids(prompt_index, 0, attempt)
        await self._steady.wait()  # leased while the weights switched timeline: start on the new ones
        seed = self.versions.sampling_seed(prompt_index, group_id, self.seed)
        async with self.versions.generating(prompt_index):  # lockstep: the prompt's exact policy version
            with self.stats.generate:
                if self.episodes is not None:
                    samples = await self.episodes.run_group(
                        self.engine, problem, self.config.group_size, self.config.sampling,
                        f"{group_id}@{self.rollout_id}", self.config.engine.max_model_len, seed, prompt_ids,
                        prompt_index=prompt_index)
                else:
                    samples = await self.engine.generate(prompt_ids, self.config.group_size, self.config.sampling,
                                                         request_id=f"{group_id}@{self.rollout_id}", seed=seed)
        timeline = self.timeline  # of the weights that sampled the newest tokens (no await since they did)
        if self.episodes is not None:
            finish = self._finish_episodes(prompt_index, attempt, problem, reward_fn, samples, timeline)
        else:
            finish = self._finish_group(prompt_index, attempt, problem, reward_fn, prompt_ids, samples, timeline)
        if self.spool is None:
            await finish
            return
        # With a spool, a generated group is scored and made durable even if this task is cancelled (stop,
        # shutdown): run() waits for these before it returns.
        task = asyncio.ensure_future(finish)
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)
        await asyncio.shield(task)

    async def _finish_group(self, prompt_index: int, attempt: int, problem, reward_fn, prompt_ids: list[int],
                            samples, timeline: int = SHARED) -> None:
        """Score a generated group, build its trajectories (``policy_timeline``: ``timeline``, SHARED for a
        sample whose newest span is version 0) and deliver them (spool or replay)."""
        group = Group([s.text for s in samples], [self.task.messages(problem)] * len(samples), problem.entry,
                      [list(s.token_ids) for s in samples])
        with self.stats.score:
            score = (await score_groups([(reward_fn, group)]))[0]  # off the event loop
        scored = score.results
        rows = []
        for i, s in enumerate(samples):
            tid, gid = make_ids(prompt_index, i, attempt)
            rows.append(Trajectory(
                trajectory_id=tid, group_id=gid, prompt_index=prompt_index, sample_index=i, attempt=attempt,
                task=problem.task, prompt_token_ids=prompt_ids, response_token_ids=list(s.token_ids),
                behaviour_logprobs=list(s.logprobs), reward=scored[i].reward, reward_error=scored[i].error,
                finish_reason=s.finish_reason, version_span_starts=list(s.version_span_starts),
                version_span_versions=list(s.version_span_versions), reward_fn_version=scored[i].version,
                rollout_id=self.rollout_id, created_at=time.time(),
                policy_timeline=label(s.version_span_versions[-1], timeline)))
        await self._deliver_rows(problem.task, rows, score.parts)

    async def _finish_episodes(self, prompt_index: int, attempt: int, problem, reward_fn, episodes,
                               timeline: int) -> None:
        """Score a group of episodes (``rollout.environment.EnvironmentConfig.task_reward``: the task's reward
        functions on the final answers, added to the environments' rewards) and deliver their rows."""
        score = None
        if self.episodes.task_reward:
            with self.stats.score:
                score = (await score_groups([(reward_fn, self.episodes.task_group(episodes, problem.entry))]))[0]
        rows = self.episodes.rows(episodes, prompt_index, attempt, problem.task, self.rollout_id, timeline,
                                  score.results if score else None)
        await self._deliver_rows(problem.task, rows, score.parts if score else {})

    async def _deliver_rows(self, task: str, rows: list[Trajectory], reward_parts) -> None:
        """Deliver a scored group's rows (``_deliver``) and count them (``reward_parts``: per reward function)."""
        await self._deliver(to_table(rows))
        self.stats.groups += 1
        self.stats.trajectories += len(rows)
        self.stats.tokens += sum(sum(r.loss_mask) for r in rows)  # sampled tokens, not observations
        self.stats.reward_sum += sum(r.reward for r in rows)
        self.stats.reward_errors += sum(bool(r.reward_error) for r in rows)
        self.stats.count_rewards(task, reward_parts)
        self.stats.count_episodes(rows)

    async def _start_spool(self, loop) -> asyncio.Task | None:
        """Recover the spool (quarantining corrupt files) and start its flusher task; None without a spool."""
        if self.spool is None:
            return None
        entries = await loop.run_in_executor(None, self.spool.recover)
        log.info("spool_recovered", rollout=self.rollout_id, pending_groups=len(entries),
                 pending_bytes=sum(e.nbytes for e in entries))
        return asyncio.create_task(self.flusher.run(self._flush_wakeup))

    async def _deliver(self, table: pa.Table) -> None:
        """Hand a finished group on: durable in the spool (the flusher sends it), else insert and wait."""
        if self.spool is None:
            await self._insert_with_retry(table)
            return
        put = asyncio.get_running_loop().run_in_executor(None, self.spool.put, table)
        self._puts.add(put)
        put.add_done_callback(self._puts.discard)
        await asyncio.shield(put)  # once generated, a group reaches the disk even if this task is cancelled
        self._flush_wakeup.set()

    async def _insert_with_retry(self, table: pa.Table) -> None:
        """Re-send until replay acknowledges; ids make a retried batch harmless. A ``ConnectionError`` (replay
        down or slow: the gRPC client maps UNAVAILABLE/DEADLINE_EXCEEDED to it) is counted, logged
        (``insert_retry``) and re-sent after ``retry_backoff_s`` seconds, doubling up to ``INSERT_BACKOFF_CAP_S``,
        however long replay stays away; any other error is raised at once. Cancelling the caller (``run()`` does
        on stop) ends a wait or an insert in flight at once."""
        loop = asyncio.get_running_loop()

        async def insert() -> None:
            await loop.run_in_executor(None, self.replay.insert, table)

        retrying = AsyncRetrying(retry=retry_if_exception_type(ConnectionError),
                                 wait=doubling(self.config.retry_backoff_s, INSERT_BACKOFF_CAP_S),
                                 before_sleep=self._insert_retry)
        with self.stats.insert:
            await retrying(insert)

    def _insert_retry(self, state: RetryCallState) -> None:
        self.stats.insert_retries += 1
        log.warning("insert_retry", rollout=self.rollout_id, error=str(state.outcome.exception())[:200],
                    retry_in_s=state.upcoming_sleep)

    def _prompt_ids(self, question: str) -> list[int]:
        ids = self.tokenizer.apply_chat_template(self.task.messages(question), add_generation_prompt=True,
                                                 tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    # ---- evaluation ---------------------------------------------------------------------------
    async def evaluate(self, config: EvalConfig | None = None) -> EvalResult:
        """Evaluate the current weights on the task's held-out sets (``rollout.evaluation.evaluate``): greedy
        accuracy and, with ``config.n_samples = k > 0``, mean@k and pass@k per set, plus every completion.
        ``config`` ``None``: ``EvalConfig()`` (all sets, k = 1). A budget left unset is the training one
        (``sampling.max_new_tokens``). Raises ``ValueError`` for a set the task does not have."""
        if self.episodes is not None:  # a multi-turn environment: each problem is an episode
            return await evaluate_episodes(self.task, self.engine, self.episodes, self._prompt_ids,
                                           config or EvalConfig(), self.config.sampling.max_new_tokens,
                                           self.config.engine.max_model_len)
        return await evaluate(self.task, self.engine, self._prompt_ids, config or EvalConfig(),
                              self.config.sampling.max_new_tokens)
