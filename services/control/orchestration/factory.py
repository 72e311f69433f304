"""How the supervisor creates services: each one a detached, named Ray actor built from the recipe.

Crash tests: the recipe's ``faults`` section arms fault points per incarnation — the i-th actor this factory
creates for a service name gets the i-th spec as ``GYRE_FAULT_POINT`` (``ServiceFactory.fault_env``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_fixed

from gyre import faults
from gyre.services.common.run_token import service_security
from gyre.services.common.cpus import cpu_env
from gyre.services.common.service_info import ServiceInfo
from gyre.services.common.logs import LOG_DIR_ENV
from gyre.services.common.names import ROLES, ServiceName
from gyre.services.control.outputs.run_dir import replay_shard_dir
from gyre.services.control.recipe.schema import Recipe
from gyre.services.control.commands.reward_swaps import SWAP_JOURNAL, RewardSwaps
from gyre.services.learner import group as learner_group
from gyre.services.learner.actor import LearnerActor, LearnerRankActor, rank_env
from gyre.services.replay.actor import ReplayActor
from gyre.services.reward_model.actor import RewardModelActor
from gyre.services.rollout.actor import RolloutActor
from gyre.services.rollout.host import HostedRollout, RolloutHost


__all__ = ["ROLES", "FIRE_LOG", "Service", "ServiceFactory", "actor_name"]

FIRE_LOG = "faults_fired.jsonl"
"""File name, under the run directory, of the fault points' fire log (``faults``)."""
NAME_TAKEN_POLL_S = 0.5
"""Seconds between tries at creating an actor whose name a killed predecessor still holds."""
HOST_CHECK_S = 2.0
"""A host process seen alive this recently is used without asking again (one tick starts many identities on it)."""
HOST_PING_TIMEOUT_S = 5.0
"""Longest wait for a host process's ``ping`` before it is taken for dead and replaced."""
NAME_TAKEN_PATIENCE_S = 60.0
"""Seconds such tries go on before Ray's "already taken" ``ValueError`` is raised."""


def actor_name(run: str, service: str) -> str:
    """Ray actor name of a service: ``gyre:{run}:{service}`` (service: replay, learner, rollout-N, controller)."""
    return f"gyre:{run}:{service}"


@dataclass
class Service:
    """One supervised service instance."""

    id: ServiceName
    """``replay`` (or ``replay-shard-{k}``), ``learner``, ``rollout-{i}`` or ``reward_model``."""
    handle: ray.actor.ActorHandle
    address: str | None
    """gRPC address to health-check (replay's, the learner's WeightService); ``None`` for a rollout."""
    restarts: int = 0
    """Replacements the supervisor created for this service (each handled death creates exactly one)."""
    failures: int = 0
    """Consecutive failed health checks."""
    incarnation: int = 0
    """0-based index of this actor among those the factory created for the name (``ServiceFactory.newest``); the
    fault arming and the fire log use the same index."""
    info: ServiceInfo | None = None
    """Last ``describe()`` answer (``services.common.service_info``: the record of its kind); ``None`` before."""
    followers: list = field(default_factory=list)
    """The learner's ranks >= 1 (``LearnerRankActor`` handles) when ``placement.learner.world_size > 1``."""

    @property
    def name(self) -> str:
        return str(self.id)

    @property
    def role(self) -> str:
        return self.id.role

    @property
    def version(self) -> int | None:
        """Policy version of the last ``describe()`` (``None`` before the first, and for replay)."""
        return self.info.version if self.info is not None else None


class ServiceFactory:
    """Creates (or re-attaches to) the detached, named service actors of one recipe."""

    def __init__(self, recipe: Recipe, env: dict, fingerprint: str) -> None:
        out = recipe.out_dir.resolve()
        self.log_dir = out / "logs"
        """Each service appends its log lines to ``{log_dir}/{service}.log`` too (``services.common.logs``)."""
        self.recipe, self.env, self.fingerprint = recipe, {**env, LOG_DIR_ENV: str(self.log_dir)}, fingerprint
        self.security = service_security(recipe.security, out)
        """What every service gets (``services.common.run_token``: with TLS off loopback and no token, the run's own)."""
        self.replay_dir = recipe.replay.dir or str(out / "replay")
        self.checkpoint_dir = out / "checkpoints"
        self.rollout_journal_dir = out / "rollouts"
        """Each rollout's run journal goes to ``{rollout_journal_dir}/rollout-{i}.jsonl`` (``gyre check``)."""
        self.fire_log = out / FIRE_LOG
        """Where armed incarnations log the fault points that fired (``faults.read_fire_log``)."""
        self.swaps = RewardSwaps(recipe.task, out / SWAP_JOURNAL)
        """The run's journaled reward swaps (``gyre reward swap``): every rollout is created with them in force."""
        self.incarnations: dict[str, int] = {}
        self.hosts: dict[int, tuple] = {}
        """Host number → ``(RolloutHost handle, when last seen alive)``: the processes of hosted rollouts."""
        self.host_generations: dict[int, int] = {}
        """Service name → actors created for it by this factory (re-attached ones do not count)."""
        self.model_rewards = recipe.model_rewards()
        """The recipe's ``{model: ...}`` rewards (``Recipe.model_rewards``): the reward-model service loads them."""

    def has(self, role: str) -> bool:
        """Whether this run has a service of ``role`` (every role but ``reward_model``, which runs when a task's
        reward names a model)."""
        return role != "reward_model" or bool(self.model_rewards)

    def newest(self, service: str) -> int:
        """Incarnation (0-based) of the newest actor this factory created for ``service``; ``0`` before any (a
        re-attached actor of an earlier driver counts as incarnation 0)."""
        return max(self.incarnations.get(service, 0) - 1, 0)

    def fault_env(self, service: str, incarnation: int) -> dict:
        """``env_vars`` of incarnation ``incarnation`` (0-based) of ``service``: ``self.env`` plus, when the
        recipe's ``faults[service]`` arms that incarnation, ``GYRE_FAULT_POINT`` and the fire log's variables
        (``faults.armed_env``; the log is ``{run_dir}/faults_fired.jsonl``)."""
        specs = self.recipe.faults.get(service, [])
        spec = specs[incarnation] if incarnation < len(specs) else ""
        return {**self.env, **faults.armed_env(spec, self.fire_log, service, incarnation)}

    def cpu_env(self, role: str, service: str) -> dict:
        """``GYRE_CPUS`` / ``OMP_NUM_THREADS`` of ``service`` from ``placement.<role>.cpus`` (``{}`` when unset;
        ``services.common.cpus``): rollout ``i`` and learner rank ``r`` take their entry of a list."""
        return cpu_env(getattr(self.recipe.placement, role).cpus_for(ServiceName.parse(service).index))

    def _options(self, role: str, service: str, env: dict | None = None, **extra) -> dict:
        """``ActorClass.options`` of one service; a rollout also gets the recipe's ``ray.runtime_env`` (reward
        functions are imported there), its ``env_vars`` merged under gyre's."""
        env = self.env if env is None else env
        runtime_env = {"env_vars": env}
        if role == "rollout" and self.recipe.ray.runtime_env:
            user = dict(self.recipe.ray.runtime_env)
            runtime_env = {**user, "env_vars": {**user.get("env_vars", {}), **env}}
        return {"name": actor_name(self.recipe.name, service), "namespace": self.recipe.ray.namespace,
                "lifetime": "detached", "runtime_env": runtime_env,
                **getattr(self.recipe.placement, role).actor_options(), **extra}

    def attach(self, service: str) -> ray.actor.ActorHandle | None:
        """The live actor of ``service`` left by an earlier driver of this run, or ``None``."""
        try:
            return ray.get_actor(actor_name(self.recipe.name, service), namespace=self.recipe.ray.namespace)
        except ValueError:
            return None

    def _create(self, cls, role: str, service: str, *args, scheduling_strategy=None, **kwargs) -> ray.actor.ActorHandle:
        """A new actor; retried every ``NAME_TAKEN_POLL_S`` seconds for up to ``NAME_TAKEN_PATIENCE_S`` while a
        killed predecessor still holds the name (``ray.kill`` is async: Ray's ``ValueError`` "... is already
        taken"), as the same incarnation. Raises that ``ValueError`` after the patience, other errors at once."""
        incarnation = self.incarnations.get(service, 0)
        self.incarnations[service] = incarnation + 1
        env = {**self.fault_env(service, incarnation), **self.cpu_env(role, service)}
        extra = {"max_concurrency": 4} if role == "learner" else {}
        if scheduling_strategy is not None:
            extra["scheduling_strategy"] = scheduling_strategy
        name_taken = retry_if_exception(lambda exc: isinstance(exc, ValueError) and "already" in str(exc))
        retrying = Retrying(retry=name_taken, wait=wait_fixed(NAME_TAKEN_POLL_S),
                            stop=stop_after_delay(NAME_TAKEN_PATIENCE_S), reraise=True)
        return retrying(lambda: cls.options(**self._options(role, service, env, **extra)).remote(*args, **kwargs))

    def replay(self, shard: int = 0) -> Service:
        """Replay shard ``shard`` (``replay``, or ``replay-shard-{k}`` of a sharded replay): its own process, WAL and
        snapshots in ``replay_shard_dir(shard)``, restored from there when they exist; blocks until it serves."""
        sid = ServiceName("replay", shard)
        config = {**self.recipe.replay.model_dump(), "shard": shard}
        handle = self._create(ReplayActor, "replay", str(sid), config, dir=self.replay_shard_dir(shard),
                              security=self.security, run_id=self.recipe.name)
        return Service(sid, handle, ray.get(handle.address.remote()), incarnation=self.newest(str(sid)))

    def replay_shard_dir(self, shard: int) -> str:
        """Directory of replay shard ``shard``: the run's replay directory itself when replay is not sharded, else
        ``{replay dir}/shard-{k}``."""
        return replay_shard_dir(self.replay_dir, shard, self.recipe.replay.shards)

    def reward_model(self) -> Service:
        """The reward-model service (``services.reward_model``), with the recipe's model rewards loaded; blocks
        until it serves."""
        handle = self._create(RewardModelActor, "reward_model", "reward_model", self.recipe.reward_model.model_dump(),
                              self.model_rewards, security=self.security, run_id=self.recipe.name)
        return Service(ServiceName("reward_model"), handle, ray.get(handle.address.remote()),
                       incarnation=self.newest("reward_model"))

    def learner(self, replay_address: str, restarted: bool = False) -> Service:
        """The learner: one ``LearnerActor``, or with ``placement.learner.world_size > 1`` rank 0 plus
        ``LearnerRankActor`` ranks ``learner-rank-{r}``, one per bundle of the learner's placement group
        (``services.learner.group``). Blocks until rank 0 serves weights."""
        cfg = self.recipe.learner.model_dump()
        cfg["fingerprint"] = cfg["fingerprint"] or self.fingerprint
        if restarted and any(self.checkpoint_dir.glob("global_step_*")):
            cfg["resume"] = "auto"  # a restarted learner rejoins from its own newest verified checkpoint
        kwargs = {"checkpoint_dir": str(self.checkpoint_dir), "security": self.security, "run_id": self.recipe.name,
                  "weight_transport": self.recipe.rollout.engine.weight_transport.model_dump()}
        world = self.recipe.placement.learner.world_size
        if world == 1:
            handle = self._create(LearnerActor, "learner", "learner", cfg, replay_address, **kwargs)
            return Service(ServiceName("learner"), handle, ray.get(handle.weights_address.remote()),
                           incarnation=self.newest("learner"))
        group = learner_group.LearnerGroup(self.recipe)
        return learner_group.start_on_rendezvous(  # again on a new port if rank 0 finds this one taken
            group.rendezvous, lambda addr, port: self._learner_group(group, cfg, replay_address, kwargs, addr, port))

    def _learner_group(self, group: learner_group.LearnerGroup, cfg: dict, replay_address: str, kwargs: dict,
                       master_addr: str, master_port: int) -> Service:
        """Start every rank of a multi-rank learner on the rendezvous ``master_addr:master_port``; blocks until
        rank 0 serves weights. Kills every rank and re-raises if any fails to start."""
        world = group.world_size
        followers = [self._create(LearnerRankActor, "learner", str(ServiceName("learner", r)), cfg,
                                  rank_env(r, world, master_addr, master_port), run_id=self.recipe.name,
                                  scheduling_strategy=group.bundle(r)) for r in range(1, world)]
        handle = self._create(LearnerActor, "learner", "learner", cfg, replay_address, **kwargs,
                              ranks=rank_env(0, world, master_addr, master_port), scheduling_strategy=group.bundle(0))
        for follower in followers:
            follower.follow.remote()  # runs once its DeepSpeed init (a collective with rank 0's) returned
        try:  # a rank that dies while starting fails this at once (rank 0 would wait in the rendezvous)
            *_, address = ray.get([f.describe.remote() for f in followers] + [handle.weights_address.remote()],
                                  timeout=learner_group.READY_TIMEOUT_S)
        except Exception:
            for h in [handle, *followers]:  # the group starts whole or not at all; the supervisor retries
                ray.kill(h, no_restart=True)
            raise
        return Service(ServiceName("learner"), handle, address, followers=followers, incarnation=self.newest("learner"))

    def attach_followers(self) -> list | None:
        """The live ranks >= 1 of a re-attached multi-rank learner, or ``None`` if any is missing."""
        ranks = range(1, self.recipe.placement.learner.world_size)
        handles = [self.attach(str(ServiceName("learner", r))) for r in ranks]
        return None if any(h is None for h in handles) else handles

    def begin_rollout(self, index: int, replay_address: str, weights_address: str,
                      reward_model_address: str | None = None):
        """Create ``rollout-{index}`` and start its setup (vLLM start, weight subscription); returns
        ``(handle, setup ObjectRef)`` without waiting. Its task is the recipe's with the journaled reward swaps
        applied (``RewardSwaps.task_config``)."""
        name = str(ServiceName.rollout(index))
        per_process = self.recipe.placement.rollout.rollouts_per_process
        if per_process > 1:  # an identity in host process index // M (services.rollout.host)
            self.incarnations[name] = self.incarnations.get(name, 0) + 1
            handle = HostedRollout(self._host(index // per_process), name)
        else:
            handle = self._create(RolloutActor, "rollout", name)
        task = self.swaps.task_config().model_dump()
        return handle, handle.setup.remote(name, self.recipe.rollout.model_dump(), task,
                                           replay_address, weights_address, self.recipe.seed + index, self.security,
                                           run_id=self.recipe.name, journal_dir=str(self.rollout_journal_dir),
                                           reward_model_address=reward_model_address)

    def _host(self, h: int):
        """Host process ``h`` of hosted rollouts (``placement.rollout.rollouts_per_process``): the live one, else a new
        one (its predecessor died, taking its identities with it). Hosts are owned by this driver (not detached):
        they end with it, and a new driver starts its own."""
        host, checked = self.hosts.get(h, (None, 0.0))
        if host is not None and time.monotonic() - checked < HOST_CHECK_S:
            return host
        if host is not None:
            try:
                ray.get(host.ping.remote(), timeout=HOST_PING_TIMEOUT_S)
                self.hosts[h] = (host, time.monotonic())
                return host
            except (RayActorError, GetTimeoutError):
                ray.kill(host, no_restart=True)
        generation = self.host_generations[h] = self.host_generations.get(h, -1) + 1
        name = f"rollout-host-{h}.{generation}"
        options = {**self._options("rollout", name), "lifetime": None, "name": None}
        host = RolloutHost.options(**options).remote(self.recipe.name, name)
        self.hosts[h] = (host, time.monotonic())
        return host

    def release_hosts(self) -> None:
        """Kill every host process of hosted rollouts (``Supervisor.shutdown``, after their identities stopped)."""
        for host, _ in self.hosts.values():
            ray.kill(host, no_restart=True)
        self.hosts.clear()

    def rollouts(self, indices: list[int], replay_address: str, weights_address: str,
                 reward_model_address: str | None = None) -> list[Service]:
        """Rollouts ``rollout-{i}`` for each index, set up concurrently (blocks until all are)."""
        started = [self.begin_rollout(i, replay_address, weights_address, reward_model_address) for i in indices]
        ray.get([ref for _, ref in started])
        return [Service(ServiceName.rollout(i), h, None, incarnation=self.newest(str(ServiceName.rollout(i))))
                for i, (h, _) in zip(indices, started)]
