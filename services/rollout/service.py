"""The rollout service: vLLM engine + worker loop + weight subscriber, and its run journal. ``RolloutService`` is the
plain class; it runs as its own Ray actor (``services.rollout.actor.RolloutActor``, one process per rollout) or, with
``placement.rollout.rollouts_per_process > 1``, as one of many identities in a ``RolloutHost`` process (fleet
simulation on the simulated engine). Shares the actor conventions of ``services.common.actor_env`` (``describe``,
pushed addresses)."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from pathlib import Path

from gyre.services.common.actor_env import node_ip, security_config
from gyre.services.common.service_info import RolloutInfo
from gyre.services.common.logs import bind_policy_version
from gyre.services.common.replay_links import TrackedReplay, replay_connector


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str):
    """The tokenizer of ``model``, loaded once per process (the identities of a ``RolloutHost`` share it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


class RolloutService:
    """A rollout service (async): vLLM engine + worker loop + weight subscriber.

    Args:
        hosted: one of many identities in a ``RolloutHost`` process: the host configures the process's logging and
            CPU pinning once, and the identity serves no metrics port of its own.
    """

    def __init__(self, hosted: bool = False) -> None:
        self.hosted = hosted

    async def setup(self, rollout_id: str, config: dict, task_config: dict, replay_address: str,
                    weights_address: str, seed: int, security: dict | None = None, run_id: str = "run",
                    metrics_port: int | None = 0, journal_dir: str | None = None,
                    reward_model_address: str | None = None) -> int:
        """Start the engine and subscribe to weights; returns the pid. ``reward_model_address``: the run's
        reward-model service, which scores its ``{model: ...}`` rewards (``None``: the run has none). With ``config["spool_dir"]`` the
        rollout spools under ``{spool_dir}/{rollout_id}`` (a restarted rollout flushes what it left).
        With ``journal_dir`` it journals every acknowledged insert and applied policy version to
        ``{journal_dir}/{rollout_id}.jsonl`` (``proto.journal``; checked by ``gyre check``)."""
        from gyre.proto.journal import Journal
        from gyre.rollout.dataset_source import PromptBudget
        from gyre.rollout.tasks import TaskConfig, TaskSource
        from gyre.rollout.config import RolloutConfig
        from gyre.rollout.versions import version_source
        from gyre.rollout.worker import RolloutWorker
        from gyre.services.common.cpus import pin_from_env
        from gyre.services.common.logs import configure_logging
        from gyre.services.common.observability import RolloutMetrics, serve

        if not self.hosted:
            configure_logging(run_id, rollout_id)
            pin_from_env(rollout_id)  # placement.<role>.cpus, before any compute thread starts
        else:
            metrics_port = None
        self.rollout_id, self.security = rollout_id, security_config(security)
        self.reward_models = None
        if reward_model_address is not None:
            await self.set_reward_model_address(reward_model_address)
        cfg = RolloutConfig(**config)
        if cfg.spool_dir:
            cfg = cfg.model_copy(update={"spool_dir": os.path.join(cfg.spool_dir, rollout_id)})
        self.loop = asyncio.get_running_loop()
        if cfg.engine.kind == "simulated":  # benchmarks: sleeps instead of sampling (rollout.sim_engine)
            from gyre.rollout.sim_engine import SimulatedEngine as Engine
        else:
            from gyre.rollout.engine import RolloutEngine as Engine
        versions = version_source(cfg)  # where each group's policy version comes from (rollout.versions)
        self.engine = await Engine.start(cfg.engine, initial_version=versions.initial_engine_version)
        tokenizer = _tokenizer(cfg.engine.model)
        self.journal = Journal(Path(journal_dir) / f"{rollout_id}.jsonl") if journal_dir is not None else None
        self.journaled_version: tuple[int, int] | None = None
        """``(version, timeline)`` last journaled."""
        self._journal_lock = threading.Lock()  # setup (event loop) and the subscriber thread both journal
        connect = replay_connector(self.security)
        self.replay = TrackedReplay(connect(replay_address), self.journal, connect=connect)
        # dataset prompts that do not fit are skipped; evaluation's budget defaults to the training one (eval:)
        budget = PromptBudget.for_tokenizer(tokenizer, cfg.engine.max_model_len, cfg.sampling.max_new_tokens,
                                            cfg.sampling.max_new_tokens)
        self.worker = RolloutWorker(rollout_id, cfg, TaskSource(TaskConfig(**task_config), budget), self.engine,
                                    self.replay, tokenizer, seed, versions)
        self.engine_config, self.subscriber, self.bootstrapped = cfg.engine, None, None
        self.metrics = RolloutMetrics(run_id, rollout_id, source=lambda: self.worker.stats.as_dict(self._version()))
        host = self.security.bind_host if self.security is not None else "127.0.0.1"
        self.metrics_port = serve(self.metrics.registry, host, metrics_port) if metrics_port is not None else None
        self._start_relay(host)
        await self.set_weights_address(weights_address)
        self._journal_weights()
        self.task, self.stopped = None, False
        self.staged_reward: dict | None = None
        """Rewards built by ``prepare_reward``, put in force by ``commit_reward`` (``TaskSource.prepare_swap``)."""
        return os.getpid()

    def _start_relay(self, host: str) -> None:
        """With ``weight_transport.relay_fanout``: serve this rollout's weight relay (``services.rollout.transport
        .relay``), fed by its own subscriber; the supervisor points other rollouts at it."""
        from gyre.services.common.actor_env import advertised_host

        self.relay_cache = self.relay_server = self.relay_address = None
        self.learner_address, self.relay_upstreams = None, ()
        if getattr(self.engine_config.weight_transport, "relay_fanout", None) is None:
            return
        from gyre.services.rollout.transport.relay import RelayCache, serve_relay

        self.relay_cache = RelayCache()
        self.relay_server, port = serve_relay(self.relay_cache, host, security=self.security)
        self.relay_address = f"{advertised_host(host)}:{port}"

    async def set_relay_upstreams(self, relays: list[str]) -> None:
        """Fetch weights from these relays (nearest first: the parent, its parent, ...) before the learner; pushed
        by the supervisor (``services.control.orchestration.relay_tree``). No-op when unchanged."""
        if tuple(relays) != self.relay_upstreams:
            self.relay_upstreams = tuple(relays)
            await self.set_weights_address(self.learner_address)

    async def set_weights_address(self, address: str) -> None:
        """(Re-)subscribe to the learner's WeightService at ``address`` through the configured transport
        (``engine.weight_transport``: grpc | nccl), from the version we have (no-op when already subscribed
        there), through this rollout's relay upstreams first when it has any (``set_relay_upstreams``). The first
        subscription bootstraps: the engine reaches the learner's newest version (or the newest export in
        ``engine.bootstrap_dir`` if the learner is unreachable, said loudly) before any generation starts."""
        from gyre.services.rollout.transport import make_transport
        from gyre.services.rollout.transport.bootstrap import BootstrapResult, bootstrap

        self.learner_address = address
        upstreams = (*self.relay_upstreams, address)
        if self.subscriber is not None and getattr(self.subscriber, "upstreams", (self.subscriber.address,)) \
                == upstreams:
            return
        if self.subscriber is not None:  # off the event loop: its thread may be applying a version on it
            await asyncio.to_thread(self.subscriber.stop)
        extra = {"relays": self.relay_upstreams, "relay": self.relay_cache} if self.relay_cache is not None else {}
        self.subscriber = make_transport(self.engine_config.weight_transport, address, self._on_version,
                                         have_version=self.engine.version, name=self.rollout_id,
                                         security=self.security, have_timeline=self.worker.timeline, **extra)
        if self.bootstrapped is None:  # lockstep: nothing to catch up to (VersionSource.first_subscription)
            self.bootstrapped = await self.worker.versions.first_subscription(
                self.subscriber, lambda: bootstrap(self.engine, self.subscriber, self.engine_config), BootstrapResult)
            if self.bootstrapped.source == "disk":  # an export of unknown timeline: the learner's next offer wins
                from gyre.proto.timeline import UNKNOWN

                self.worker.timeline = UNKNOWN
        else:
            self.subscriber.start()

    async def set_reward_model_address(self, address: str) -> None:
        """Score model rewards at the reward-model service at ``address`` (a restarted one's new address; requests
        waiting meanwhile retry there). Installs the process's transport (``rollout.rewards.model``) the first time."""
        from gyre.rollout.rewards.model import set_transport
        from gyre.services.rollout.reward_client import GrpcRewardModels

        if getattr(self, "reward_models", None) is None:
            self.reward_models = GrpcRewardModels(address, getattr(self, "security", None))
            set_transport(self.reward_models)
        else:
            self.reward_models.set_address(address)

    async def set_replay_address(self, address: str) -> None:
        """Send leases/inserts to a restarted replay (``ReplayLink.reroute``; no-op for the same address)."""
        self.replay.reroute(address)

    def _on_version(self, version, tensors, timeline) -> None:
        # Called in the subscriber thread: apply on the actor's event loop and wait for it.
        asyncio.run_coroutine_threadsafe(self.worker.apply_weights(version, tensors, timeline), self.loop).result()
        # The served version, not the engine's: in lockstep the engine stays at -1 until a prompt loads its
        # version, and binding -1 raised here, so the subscriber took the offer as refused and sent it again.
        bind_policy_version(self._version())
        self._journal_weights()

    def _journal_weights(self) -> None:
        """Journal the engine's policy version once per new version (and once at setup); the version is
        read under the lock, so two callers cannot write an older version after a newer one."""
        if self.journal is None:
            return
        with self._journal_lock:
            # lockstep: the newest offered (each prompt loads its own exact one); the timeline: after a learner
            # rewind the same or a lower number names other weights (proto.timeline)
            served = (self._version(), self.worker.timeline)
            if served != self.journaled_version:
                self.journal.append({"event": "weights", "version": served[0], "timeline": served[1],
                                     "pid": os.getpid(), "time": time.time()})
                self.journaled_version = served

    async def swap_reward(self, config) -> dict[str, str]:
        """Swap reward functions in flight (``RolloutWorker.swap_reward``: validated first, applies to groups
        started afterwards); returns task → reward version. Raises on an invalid config (nothing changes)."""
        return self.worker.swap_reward(config)

    async def prepare_reward(self, config) -> dict[str, str]:
        """Phase one of a fleet-wide swap (``services.control.commands.reward_swaps``): build and check ``config``'s rewards
        (``TaskSource.prepare_swap``) and stage them, changing nothing; returns the ``{task: reward_fn_version}``
        a ``commit_reward`` would put in force. Raises on an invalid config or a misfit (nothing is staged)."""
        self.staged_reward = None
        staged = self.worker.task.prepare_swap(config)
        self.staged_reward = staged
        return {**self.worker.task.reward_versions(), **{task: r.version for task, r in staged.items()}}

    async def commit_reward(self) -> dict[str, str]:
        """Phase two: put the staged rewards in force for groups started from now; returns task → version.

        Raises:
            RuntimeError: nothing is staged (no ``prepare_reward``, or it was aborted).
        """
        if self.staged_reward is None:
            raise RuntimeError(f"{self.rollout_id}: no reward swap is prepared; call prepare_reward first")
        versions, self.staged_reward = self.worker.task.commit_swap(self.staged_reward), None
        return versions

    async def abort_reward(self) -> None:
        """Drop a staged swap (another rollout refused it); idempotent."""
        self.staged_reward = None

    async def start(self) -> None:
        """Start generating (no-op when already generating, e.g. a re-attached rollout); again after ``pause``
        or ``drain`` (leasing prompts again).

        Raises:
            RuntimeError: after ``stop`` (the engine is shut down; a new actor generates instead).
        """
        if self.stopped:
            raise RuntimeError(f"rollout {self.rollout_id} was stopped (its engine is shut down); start another")
        if self.task is None or self.task.done():
            self.replay.draining = False
            self.task = asyncio.create_task(self.worker.run())

    async def drain(self, timeout_s: float) -> int:
        """Lease no more prompts and wait up to ``timeout_s`` seconds until every group this rollout holds
        a prompt lease for was delivered; then stop generating. Returns the prompt leases left undelivered
        (replay re-issues them after ``prompt_lease_ttl_s``)."""
        self.replay.draining = True
        deadline = self.loop.time() + timeout_s
        while self.replay.outstanding and self.task is not None and not self.task.done() \
                and self.loop.time() < deadline:
            await asyncio.sleep(0.2)
        await self.pause()
        return len(self.replay.outstanding)

    async def pause(self) -> None:
        """Stop taking new prompts; groups in flight end (their prompt leases expire and are re-issued)."""
        self.worker.stop()
        if self.task is not None:
            await self.task
            self.task = None

    def _version(self) -> int:
        """The policy version this rollout serves (``VersionSource.served``; in lockstep, the newest it was
        offered: each prompt then loads its own exact version from the version store)."""
        return self.worker.versions.served()

    async def wait_for_version(self, version: int, timeout_s: float, timeline: int | None = None) -> int:
        """Wait up to ``timeout_s`` seconds until this rollout serves ``version`` (or newer); with ``timeline``
        (the learner's, ``proto.timeline``) only weights of that timeline count, so weights a crashed learner
        published under the same number never pass for it. Returns the version served, ``-1`` when the
        timeline still differs at the deadline."""
        def reached() -> bool:
            return (self._version() >= version if timeline is None
                    else self.worker.serves(version, timeline))

        deadline = self.loop.time() + timeout_s
        while not reached() and self.loop.time() < deadline:
            await asyncio.sleep(0.2)
        return self._version() if timeline is None or reached() else -1

    async def evaluate(self, config: dict | None = None, min_version: int = -1, wait_s: float = 0.0):
        """``RolloutWorker.evaluate`` (an ``EvalResult``) with the ``rollout.evaluation.EvalConfig`` fields in
        ``config``, once this rollout serves ``min_version`` or ``wait_s`` seconds passed (it then evaluates the
        version it has; ``EvalResult.metrics["version"]`` says which). Generation goes on meanwhile; in
        lockstep the newest offered version is loaded exactly and held for the evaluation (groups needing
        another version wait for it to end)."""
        from gyre.rollout.evaluation import EvalConfig

        cfg = EvalConfig(**(config or {}))
        if min_version > self._version():
            await self.wait_for_version(min_version, wait_s)
        async with self.worker.versions.evaluating():  # lockstep: the newest offered version, loaded exactly
            return await self.worker.evaluate(cfg)

    async def stats(self) -> dict:
        return self.worker.stats.as_dict(self._version())

    async def describe(self) -> RolloutInfo:
        stats = self.worker.stats.as_dict(self._version())
        return RolloutInfo(pid=os.getpid(), node=node_ip(), generating=self.task is not None,
                           metrics_port=self.metrics_port, version=stats["version"],
                           tokens_per_s=stats["tokens_per_s"], stats=stats,
                           reward_versions=self.worker.task.reward_versions(), relay_address=self.relay_address,
                           weight_upstreams=getattr(self.subscriber, "upstreams", ()))

    async def stop(self) -> None:
        """Stop generating and shut the engine and weight subscription down; ``start`` then raises."""
        self.stopped = True
        await self.pause()
        await asyncio.to_thread(self.subscriber.stop)
        if self.relay_server is not None:
            self.relay_cache.close()
            self.relay_server.stop(grace=1)
        await self.engine.shutdown()

    async def abort(self) -> None:
        """End this identity now, as a killed process would (``RolloutHost.remove``): generation is cancelled (its
        prompt leases expire in replay and are re-issued), the weight subscription and the engine stop."""
        self.stopped = True  # (any part setup had not made yet is skipped)
        if getattr(self, "worker", None) is not None:
            self.worker.stop()
        task, self.task = getattr(self, "task", None), None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if getattr(self, "subscriber", None) is not None:
            await asyncio.to_thread(self.subscriber.stop)
        if getattr(self, "relay_server", None) is not None:
            self.relay_server.stop(grace=0)
        if getattr(self, "engine", None) is not None:
            await self.engine.shutdown()
