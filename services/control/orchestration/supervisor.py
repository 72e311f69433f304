"""The controller's supervisor: creates each service as a detached, named Ray actor, health-checks every
service each tick, restarts what is dead or hung, applies the operator's requests (scale, restart,
checkpoint) read from the run's ``ControllerState`` actor, and publishes the status ``gyre status`` shows.

Health (per service, per tick): the actor answers ``describe()`` within ``check_timeout_s`` seconds, and
for replay and the learner the standard gRPC health service at its address answers SERVING
(``grpc_common.check_health``). A dead actor is restarted at once; a live one after
``fail_threshold`` consecutive failed checks (hung). A restart is ``ray.kill`` + a new actor of the same
name and config: replay restores from its directory (snapshot + WAL), the learner resumes from its newest
verified checkpoint and re-publishes it, a rollout re-subscribes to the newest weights (its prompt leases
expire in replay and are re-issued). A server's new address is pushed to the services that dial it, by the
method ``services.control.orchestration.topology`` names (the one table of who dials whom). A rollout's replacement starts
in the background, like one added by ``scale`` (its engine takes tens of seconds), and joins once it holds
the learner's version; the ticks meanwhile keep checking the other services.

Reward swaps (``gyre reward swap``) are applied first in a tick, to every running rollout or to none
(``services.control.commands.reward_swaps``); a rollout created before the latest swap (starting, or re-attached by a new
driver) gets the swaps in force when it joins, and every rollout created afterwards is created with them.

Services are created by ``services.control.orchestration.factory.ServiceFactory`` (fault arming per incarnation there).
"""

from __future__ import annotations

import time

import ray
import structlog
from ray.exceptions import GetTimeoutError, RayActorError

from gyre.services.rollout.host import kill_service
from gyre.services.control.orchestration.relay_tree import RelayTree
from gyre.services.common.names import ServiceName
from gyre.services.common.replay_shards import join_addresses
from gyre.services.control.commands import reward_swaps
from gyre.services.control.orchestration import topology
from gyre.services.control.commands.status import run_status
from gyre.services.control.orchestration.factory import Service, ServiceFactory
from gyre.services.control.orchestration.health import health_round
from gyre.services.control.orchestration.drains import DRAIN_S, Draining, advance_drains, begin_drain
from gyre.services.control.orchestration.incarnations import Death, Starting
from gyre.services.control.orchestration.tick_times import TickTimes
from gyre.services.learner import group as learner_group

log = structlog.get_logger("supervisor")
START_TIMEOUT_S = 1800.0
"""Default ``Supervisor.start_timeout_s``: a vLLM engine of a large model on a fresh node (download, load, CUDA
graphs) takes minutes, not half an hour."""


class Supervisor:
    """Owns the services of one run; the controller calls ``tick()`` every poll (about every second).

    Args:
        factory: creates the actors.
        state: the run's ``ControllerState`` actor (desired rollout count, requests, published status).
        fail_threshold: consecutive failed checks (``check_timeout_s`` seconds each) before a live but
            unhealthy service is killed and recreated; a dead actor is recreated at the first check.
        start_timeout_s: seconds a starting rollout may take to set up (placed by Ray, engine up, weights fetched);
            past it, it is killed and its death recorded (``rollout_start_timeout``, by name), so a rollout Ray cannot
            place does not stay "starting" for ever.
    """

    def __init__(self, factory: ServiceFactory, state, fail_threshold: int = 3, check_timeout_s: float = 5.0,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        if fail_threshold < 1:
            raise ValueError(f"fail_threshold ({fail_threshold}) must be >= 1")
        self.factory, self.state = factory, state
        self.fail_threshold, self.check_timeout_s = fail_threshold, check_timeout_s
        self.start_timeout_s = start_timeout_s
        self.services: dict[str, Service] = {}
        self.starting: dict[str, Starting] = {}
        self.draining: dict[str, Draining] = {}
        """Rollouts removed by ``scale``, draining and stopping in the background (``drains``)."""
        """Rollouts being added by ``scale`` or replacing a failed one (their vLLM engine starts while the
        supervisor keeps ticking); a restarted rollout's old entry stays in ``services`` until then."""
        self.learner_generation = 0
        """Bumped on every learner restart: the training loop then re-issues ``run(remaining steps)``."""
        self.deaths: list[Death] = []
        """Every death handled, in order: one per replacement created (``restart_counts`` counts them)."""
        self.generating = False
        self.tick_times = TickTimes()
        """Durations of the ticks (the run summary's ``supervisor``; ``gyre status``)."""
        self.joined_s: dict[str, float] = {}
        """Rollout → seconds from its actor's creation (``gyre scale``, a restart) to joining the fleet at the
        learner's newest version, the last time it joined (``rollout_join_s`` in the summary and ``gyre status``)."""
        transport = factory.recipe.rollout.engine.weight_transport
        self.relay_tree = RelayTree(getattr(transport, "relay_fanout", None))
        """Points each rollout at its parent relay's weights (``relay_tree``; idle without ``relay_fanout``)."""

    # ---- topology -----------------------------------------------------------------------------
    @property
    def replay(self) -> Service:
        """Replay (shard 0 of a sharded replay)."""
        return self.services["replay"]

    def replay_shards(self) -> list[Service]:
        """Every replay shard, in shard order (one: replay itself, when not sharded)."""
        return sorted((s for s in self.services.values() if s.role == "replay"), key=lambda s: s.id)

    @property
    def replay_address(self) -> str:
        """The address replay's clients dial: its shards' addresses in shard order (``replay_shards.join_addresses``;
        one address when not sharded)."""
        return join_addresses([s.address for s in self.replay_shards()])

    @property
    def learner(self) -> Service:
        return self.services["learner"]

    def rollouts(self) -> list[Service]:
        return sorted((s for s in self.services.values() if s.role == "rollout"), key=lambda s: s.id)

    def running_rollouts(self) -> list[Service]:
        """``rollouts()`` without those being restarted (their entry is the killed incarnation)."""
        return [s for s in self.rollouts() if s.name not in self.starting]

    def start(self, num_rollouts: int) -> list[str]:
        """Re-attach to live actors of this run or create them: replay, learner, then rollouts. A re-attached
        service is told the address of each server created anew that it dials (``topology``).
        Returns the names of the services re-attached."""
        attached: list[str] = []
        shards = [(str(ServiceName("replay", k)), lambda k=k: self.factory.replay(k))
                  for k in range(self.factory.recipe.replay.shards)]
        makers = (*shards, ("reward_model", self.factory.reward_model),
                  ("learner", lambda: self.factory.learner(self.replay_address)))
        for name, make in makers:
            if not self.factory.has(ServiceName.parse(name).role):
                continue
            svc = self._attach_server(name)
            if svc is not None:
                attached.append(name)
            self.services[name] = svc if svc is not None else make()
        for name, svc in list(self.services.items()):
            if svc.role in topology.servers() and name not in attached:  # a new address
                self._announce(svc, [self.services[n] for n in attached])
        missing = []
        for i in range(num_rollouts):
            sid = ServiceName.rollout(i)
            handle = self.factory.attach(str(sid))
            if handle is not None and self._alive(handle):
                self.services[str(sid)] = Service(sid, handle, None)
                ray.get(self._tell_addresses(handle, "rollout"))
                self._catch_up_rewards(handle, 0)  # the journal's swaps, even one its dead driver did not commit
                attached.append(str(sid))
            else:
                missing.append(i)
        if missing:
            self._add_rollouts(missing)
        log.info("services_started", replay=self.replay_address, weights=self.learner.address,
                 rollouts=num_rollouts, reattached=attached)
        return attached

    def _attach_server(self, name: str) -> Service | None:
        """The live server ``name`` (a replay shard, the reward model, or the learner with all its ranks) an
        earlier driver of this run left, or ``None`` after killing whatever part of it is left (a learner group is
        only whole or restarted whole)."""
        sid = ServiceName.parse(name)
        handle = self.factory.attach(name)
        followers = self.factory.attach_followers() if sid.role == "learner" else []
        if handle is not None and followers is not None and all(map(self._alive, [handle, *followers])):
            address = ray.get(getattr(handle, topology.endpoint(sid.role).address_method).remote())
            return Service(sid, handle, address, followers=followers)
        for h in [handle, *(followers or [])]:
            if h is not None:
                kill_service(h, ray)
        return None

    def start_generation(self) -> None:
        """Every rollout starts leasing prompts (after the optional evaluation before training)."""
        ray.get([r.handle.start.remote() for r in self.rollouts()])
        self.generating = True

    def _alive(self, handle) -> bool:
        try:
            ray.get(handle.describe.remote(), timeout=self.check_timeout_s)
            return True
        except (RayActorError, GetTimeoutError):
            return False

    def _add_rollouts(self, indices: list[int]) -> list[Service]:
        """New rollouts, started concurrently; each is bootstrapped to the learner's newest policy version
        before it generates."""
        new = self.factory.rollouts(indices, self.replay_address, self.learner.address, self._address("reward_model"))
        self.services.update({svc.name: svc for svc in new})
        if self.generating:
            version = self._learner_version()
            ray.get([svc.handle.wait_for_version.remote(version, 300) for svc in new])
            ray.get([svc.handle.start.remote() for svc in new])
        return new

    def _address(self, server: str) -> str | None:
        """The current address of server role ``server`` as its clients dial it (``replay_address`` for replay;
        ``None``: this run has no such service)."""
        if server == "replay":
            return self.replay_address
        svc = self.services.get(server)
        return svc.address if svc is not None else None

    def _catch_up_rewards(self, handle, swaps_at_creation: int) -> None:
        """Put the journaled reward swaps in force on a rollout created before the latest of them (raises what
        the rollout raised: the caller treats it as a failed start)."""
        swaps = self.factory.swaps
        if swaps.count > swaps_at_creation and swaps.in_force:
            ray.get(handle.swap_reward.remote(swaps.in_force), timeout=60)

    def _apply_reward_swaps(self, requests: list[dict]) -> None:
        """Each queued swap, all or nothing over the running rollouts (``reward_swaps.apply_swap``); its result goes
        back to the ``ControllerState`` for the waiting ``gyre reward swap``."""
        for req in requests:
            result = reward_swaps.apply_swap(self.factory.swaps, req["id"], req["swap"], self.running_rollouts(),
                                             get=ray.get)
            log.info("reward_swap", id=req["id"], ok=result["ok"], versions=result["versions"], error=result["error"])
            ray.get(self.state.finish_reward_swap.remote(req["id"], result))

    def _learner_version(self) -> int:
        """The learner's policy version as of its last ``describe()`` (0 before the first)."""
        return self.learner.version if self.learner.info is not None else 0

    # ---- addresses (who dials whom: ``services.control.orchestration.topology``) ------------------------------
    def _tell_addresses(self, handle, role: str) -> list:
        """Push the current address of every server ``role`` dials (that this run has) to ``handle``; returns the
        calls' refs."""
        return [getattr(handle, topology.endpoint(server).push_method).remote(self._address(server))
                for server in topology.dialled_by(role) if server in self.services]

    def _announce(self, server: Service, among: list[Service]) -> None:
        """Push ``server``'s (new) address to the services in ``among`` whose role dials it (for a replay shard: the
        whole replay's address, with the shard's new one in it)."""
        clients = [c for c in among if c.role in topology.clients_of(server.role)]
        self._push(topology.endpoint(server.role).push_method, self._address(server.role), clients)

    def _push(self, method: str, address: str, clients: list[Service]) -> None:
        for c in clients:
            try:
                ray.get(getattr(c.handle, method).remote(address), timeout=60)
            except (RayActorError, GetTimeoutError) as exc:  # that client is down itself: restarted later,
                log.warning("address_push_failed", service=c.name, error=str(exc)[:200])  # with the new address

    # ---- one supervision round ----------------------------------------------------------------
    def tick(self) -> None:
        """Apply operator requests, check every service (restarting the failed ones), publish status; its duration
        goes to ``tick_times``."""
        t0 = time.monotonic()
        try:
            self._tick()
        finally:
            self.tick_times.add(time.monotonic() - t0)

    def _tick(self) -> None:
        requests = ray.get(self.state.take_requests.remote())
        self._apply_reward_swaps(requests.get("reward_swaps", []))  # first: what this tick creates has them
        for name in requests["restart"]:
            if name in self.services:
                self._restart_or_retry(self.services[name], reason="requested")
        checked = [svc for svc in self.services.values() if svc.name not in self.starting]  # starting: killed
        for svc, keep in zip(checked, self.check_all(checked)):
            if not keep:
                self._restart_or_retry(svc, reason=f"{svc.failures} failed health checks")
        self.scale(requests["rollouts"])
        advance_drains(self.draining)
        self._adopt_started()
        self.relay_tree.update(self.running_rollouts())
        if requests["checkpoint"]:
            log.info("checkpoint_requested", result=ray.get(self.learner.handle.request_checkpoint.remote()))
        ray.get(self.state.publish.remote(self.status()))

    def check_all(self, svcs: list[Service]) -> list[bool]:
        """``health.health_round`` over ``svcs``: per service, ``False`` once it must be restarted."""
        return health_round(svcs, self.check_timeout_s, self.fail_threshold, self.factory.recipe.security)

    def _restart_or_retry(self, svc: Service, reason: str) -> None:
        """``restart``; if the new incarnation dies while starting, the old entry stays (dead), so the next
        tick's check fails and restarts it again instead of the error ending the run."""
        try:
            self.restart(svc, reason)
        except (RayActorError, GetTimeoutError) as exc:
            log.error("restart_failed_retrying", service=svc.name, error=str(exc)[:300])

    def restart(self, svc: Service, reason: str) -> Service:
        """Kill and recreate ``svc`` with the same config; push its new address to the services dialling it.

        Accounting: the death of the incarnation being replaced is recorded (``deaths``) and ``restarts`` counts
        the replacement as soon as it is created. A replacement that dies while starting raises here (its
        ``RayActorError``); the entry then stands for that dead incarnation, so the next tick records its death and
        creates the next one — two deaths, two restarts, never folded into one."""
        log.warning("restarting_service", service=svc.name, reason=reason, restarts=svc.restarts + 1)
        for handle in [svc.handle, *svc.followers]:  # every learner rank: DeepSpeed groups restart whole
            kill_service(handle, ray)
        if svc.role == "rollout":
            return self._restart_rollout(svc, reason)
        self.deaths.append(Death(svc.name, svc.incarnation, reason))
        make = {"replay": lambda: self.factory.replay(svc.id.index), "reward_model": self.factory.reward_model,
                "learner": lambda: self.factory.learner(self.replay_address, restarted=True)}[svc.role]
        try:
            new = make()
        except (RayActorError, GetTimeoutError):
            newest = self.factory.newest(svc.name)
            if newest != svc.incarnation:  # a replacement was created and died starting: the entry stands for it
                svc.incarnation, svc.restarts = newest, svc.restarts + 1
            raise
        if svc.role == "learner":
            self.learner_generation += 1
        new.restarts = svc.restarts + 1
        self.services[svc.name] = new
        self._announce(new, [s for s in self.services.values() if s.name not in self.starting])
        new.info = ray.get(new.handle.describe.remote())
        log.info("service_restarted", service=svc.name, address=new.address, pid=new.info.pid)
        return new

    def _restart_rollout(self, svc: Service, reason: str) -> Service:
        """A rollout's replacement starts in the background (the tick goes on checking the others meanwhile); the
        dead entry stays until the new one joins in ``_adopt_started``. Restarted again while a replacement starts:
        that replacement is the incarnation that ends."""
        pending = self.starting.pop(svc.name, None)
        if pending is not None:
            kill_service(pending.handle, ray)
            self.deaths.append(Death(svc.name, pending.incarnation, reason))
            restarts = pending.restarts + 1
        else:
            self.deaths.append(Death(svc.name, svc.incarnation, reason))
            restarts = svc.restarts + 1
        handle, ref = self.factory.begin_rollout(svc.id.index, self.replay_address, self.learner.address,
                                                 self._address("reward_model"))
        self.starting[svc.name] = Starting(svc.id, handle, ref, restarts=restarts, swaps=self.factory.swaps.count,
                                           incarnation=self.factory.newest(svc.name))
        return svc

    def restart_counts(self) -> dict[str, int]:
        """Service name → replacements created (a rollout whose replacement is still starting counts it)."""
        counts = {s.name: s.restarts for s in self.services.values()}
        return {**counts, **{name: st.restarts for name, st in self.starting.items()}}

    def scale(self, desired: int | None) -> None:
        """Begin adding rollouts (they join in ``_adopt_started``), or drop starting ones and drain and
        remove the newest running ones."""
        running = self.running_rollouts()
        if desired is None or desired == len(running) + len(self.starting):
            return
        log.info("scaling_rollouts", running=len(running), starting=len(self.starting), desired=desired)
        used = ({st.id.index for st in self.starting.values()} | {s.id.index for s in running}
                | {d.index for d in self.draining.values()})  # a draining actor still holds its name
        free = (i for i in range(desired + len(used)) if i not in used)
        for _ in range(desired - len(running) - len(self.starting)):
            sid = ServiceName.rollout(next(free))
            handle, ref = self.factory.begin_rollout(sid.index, self.replay_address, self.learner.address,
                                                     self._address("reward_model"))
            self.starting[str(sid)] = Starting(sid, handle, ref, swaps=self.factory.swaps.count,
                                               incarnation=self.factory.newest(str(sid)))
        excess = len(running) + len(self.starting) - desired
        for st in sorted(self.starting.values(), key=lambda st: st.id, reverse=True)[:max(excess, 0)]:
            kill_service(self.starting.pop(str(st.id)).handle, ray)
            self.services.pop(str(st.id), None)  # a restart's killed incarnation goes with its replacement
            excess -= 1
        for svc in running[::-1][:max(excess, 0)]:
            del self.services[svc.name]  # out of the fleet now; drained in the background (``drains``)
            begin_drain(self.draining, svc, self.generating)

    def _adopt_started(self) -> None:
        """Starting rollouts whose setup returned and that hold ``target_version`` join the fleet and generate;
        one that failed its setup or died since is killed (``_start_failed``)."""
        for name, st in list(self.starting.items()):
            waited = time.monotonic() - st.since
            if waited > self.start_timeout_s:
                log.error("rollout_start_timeout", service=name, waited_s=round(waited),
                          start_timeout_s=self.start_timeout_s, setup_returned=st.setup is None)
                self._start_failed(st, TimeoutError(
                    f"{name} did not start within {self.start_timeout_s:g}s (Ray could not place it, or its setup or "
                    "first weights hang)"), reason="not started in time")
                continue
            try:
                if st.setup is not None:
                    if not ray.wait([st.setup], timeout=0)[0]:
                        continue
                    ray.get(st.setup)
                    self._catch_up_rewards(st.handle, st.swaps)  # swaps accepted while it started
                    st.setup, st.target_version = None, self._learner_version()
                    # replay or the learner may have been restarted (new address) while this one started
                    ray.get(self._tell_addresses(st.handle, "rollout"))
                info = ray.get(st.handle.describe.remote(), timeout=self.check_timeout_s)
            except GetTimeoutError:
                continue  # busy fetching weights: asked again next tick
            except ray.exceptions.RayError as exc:
                self._start_failed(st, exc)
                continue
            if info.version < st.target_version:
                continue  # still fetching the newest weights
            del self.starting[name]
            self.joined_s[name] = round(time.monotonic() - st.since, 1)
            self.services[name] = Service(st.id, st.handle, None, restarts=st.restarts, info=info,
                                          incarnation=st.incarnation)
            if self.generating:
                ray.get(st.handle.start.remote())
            log.info("service_restarted" if st.restarts else "rollout_added", service=name, version=info.version,
                     pid=info.pid, restarts=st.restarts, join_s=self.joined_s[name])

    def _start_failed(self, st: Starting, exc: Exception, reason: str = "died while starting") -> None:
        """A starting rollout failed (its setup raised, or it died): kill it. A restart's replacement leaves the old
        entry standing for this incarnation, so the next tick's check records its death and starts the next one;
        one added by ``scale`` is a death recorded here, and the next ``scale`` starts another."""
        log.error("rollout_start_failed", service=str(st.id), error=str(exc)[:500])
        kill_service(self.starting.pop(str(st.id)).handle, ray)
        old = self.services.get(str(st.id))
        if old is None:
            self.deaths.append(Death(str(st.id), st.incarnation, reason))
            return
        old.handle, old.incarnation, old.restarts = st.handle, st.incarnation, st.restarts

    def remove_rollout(self, svc: Service, drain_s: float = DRAIN_S) -> None:
        """Drain (no new prompt leases; the groups it holds leases for are finished and delivered, for up to
        ``drain_s`` seconds; any left are re-issued after ``prompt_lease_ttl_s``), shut the engine down,
        then kill the detached actor; blocks (``shutdown``: ``scale`` drains in the background instead)."""
        try:
            left = ray.get(svc.handle.drain.remote(drain_s), timeout=drain_s + 30) if self.generating else 0
            log.info("rollout_drained", service=svc.name, undelivered_prompt_leases=left)
            ray.get(svc.handle.stop.remote(), timeout=120)
        except (RayActorError, GetTimeoutError) as exc:
            log.warning("rollout_stop_failed", service=svc.name, error=str(exc)[:200])
        kill_service(svc.handle, ray)
        del self.services[svc.name]

    def status(self) -> dict:
        """Plain status of the run (what ``gyre status`` prints; ``services.control.commands.status.run_status``)."""
        return run_status(self)

    def shutdown(self) -> None:
        """Stop and kill every service actor (detached actors outlive the driver otherwise)."""
        for name in list(self.starting):
            kill_service(self.starting.pop(name).handle, ray)
        for name in list(self.draining):
            kill_service(self.draining.pop(name).handle, ray)
        for svc in self.rollouts():
            self.remove_rollout(svc)
        for name in ("learner", "reward_model", *(s.name for s in self.replay_shards())):
            svc = self.services.pop(name, None)
            if svc is None:
                continue
            try:
                ray.get(svc.handle.stop.remote(), timeout=60)
            except (RayActorError, GetTimeoutError) as exc:
                log.warning("stop_failed", service=name, error=str(exc)[:200])
            for handle in [svc.handle, *svc.followers]:
                kill_service(handle, ray)
        self.factory.release_hosts()
        learner_group.remove(self.factory.recipe)

