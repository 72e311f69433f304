"""Hand-written actor doubles for the supervisor's unit tests (no Ray): services' ``describe`` records, actor
handles that record their calls, a factory that makes them, a supervisor built on them (``unstarted``, the
``sup`` fixture) and the address pushes the handles received."""

import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from gyre.services.common.service_info import LearnerInfo, ReplayInfo, RewardModelInfo, RolloutInfo
from gyre.services.common.names import ServiceName
from gyre.services.control.orchestration import supervisor as sup_mod
from gyre.services.control.orchestration import drains, health, relay_tree, topology
from gyre.proto.weight_transport import GrpcTransportConfig
from gyre.services.control.commands import ops
from gyre.services.control.commands.ops import FleetRequests
from gyre.services.control.commands.reward_swaps import SWAP_JOURNAL, RewardSwaps
from gyre.services.control.orchestration.supervisor import Service, Supervisor
from gyre.rollout.tasks import TaskConfig


def replay_info() -> ReplayInfo:
    return ReplayInfo(pid=1, node="n", address="replay:1", replay_groups=0, replay_trajectories=0, learner_version=0,
                      inserts_per_s=0.0)


def learner_info(version: int = 5) -> LearnerInfo:
    return LearnerInfo(pid=2, node="n", address="weights:1", version=version, timeline=0, running=True,
                       resumed_from="", last_checkpoint="", checkpoint_age_s=None, tokens_per_s=None)


def rollout_info(pid: int, version: int = 5, relay_address: str | None = None) -> RolloutInfo:
    return RolloutInfo(pid=pid, node="n", version=version, generating=True, tokens_per_s=0.0,
                       relay_address=relay_address)


class Call:
    """What ``handle.method.remote(...)`` returns here: resolved by the fake ``ray.get``."""

    def __init__(self, fn, args, method="", owner=None):
        self.fn, self.args, self.method, self.owner = fn, args, method, owner


class FakeHandle:
    """An actor double: ``handle.name.remote(*args)`` calls ``behaviour[name](*args)`` when resolved."""

    def __init__(self, name: str, **behaviour):
        self.name, self.calls, self.killed = name, [], False
        self.behaviour = {"describe": replay_info, **behaviour}

    def __getattr__(self, method):
        def remote(*args):
            self.calls.append((method, args))
            return Call(lambda *a: self._run(method, *a), args, method, self)
        return SimpleNamespace(remote=remote)

    def _run(self, method, *args):
        if self.killed:
            raise RayActorError()
        fn = self.behaviour.get(method)
        return fn(*args) if fn is not None else None


def _health_round(refs) -> bool:
    """``refs`` are a health round's ``describe`` calls (``Supervisor.check_all``), not a starting rollout's setup."""
    return all(getattr(r, "method", "") == "describe" for r in refs)


def _get(x, timeout=None):
    if isinstance(x, list):
        return [_get(i) for i in x]
    return x.fn(*x.args) if isinstance(x, Call) else x


class FakeFactory:
    def __init__(self, relay_fanout=None, replay_shards=1):
        self.made = {"replay": 0, "learner": 0, "rollout": 0, "reward_model": 0}
        self.incarnations: dict[str, int] = {}
        self.replay_dialled: dict[str, str] = {}
        """Service name → the replay address it was created with."""
        transport = GrpcTransportConfig(relay_fanout=relay_fanout)
        self.recipe = SimpleNamespace(security=None, rollout=SimpleNamespace(engine=SimpleNamespace(
            weight_transport=transport)), replay=SimpleNamespace(shards=replay_shards))
        self.log_dir = Path("/runs/r/logs")
        self.swaps = RewardSwaps(TaskConfig(), Path(tempfile.mkdtemp(prefix="gyre-test-")) / SWAP_JOURNAL)

    def _created(self, name: str) -> int:
        self.incarnations[name] = self.incarnations.get(name, 0) + 1
        return self.incarnations[name] - 1

    def newest(self, name: str) -> int:
        return max(self.incarnations.get(name, 0) - 1, 0)

    def replay(self, shard=0):
        self.made["replay"] += 1
        sid = ServiceName("replay", shard)
        return Service(sid, FakeHandle(str(sid)), f"replay:{self.made['replay']}", incarnation=self._created(str(sid)))

    with_reward_model = False
    """A run whose reward names a model: every role of the topology."""

    def has(self, role):
        return role != "reward_model" or self.with_reward_model

    def reward_model(self):
        self.made["reward_model"] += 1
        info = lambda: RewardModelInfo(pid=3, node="n", address="rm:1", models={"/m/rm": "rm:classifier:rm@abc"},
                                       counts={"batches": 2})
        return Service(ServiceName("reward_model"), FakeHandle("reward_model", describe=info),
                       f"rm:{self.made['reward_model']}", incarnation=self._created("reward_model"))

    def learner(self, replay_address, restarted=False):
        self.made["learner"] += 1
        self.replay_dialled["learner"] = replay_address
        handle = FakeHandle("learner", describe=learner_info)
        return Service(ServiceName("learner"), handle, f"weights:{self.made['learner']}",
                       incarnation=self._created("learner"))

    def attach_followers(self):
        return []

    def release_hosts(self):
        pass

    def begin_rollout(self, index, replay_address, weights_address, reward_model_address=None):
        self.made["rollout"] += 1
        self.replay_dialled[f"rollout-{index}"] = replay_address
        self._created(f"rollout-{index}")
        made = self.made["rollout"]
        handle = FakeHandle(f"rollout-{index}", describe=lambda: rollout_info(10 + index,
                                                                             relay_address=f"relay-{made}:1"))
        return handle, handle.setup.remote()

    def rollouts(self, indices, replay_address, weights_address, reward_model_address=None):
        return [Service(ServiceName.rollout(i), self.begin_rollout(i, replay_address, weights_address)[0], None,
                        incarnation=self.newest(f"rollout-{i}")) for i in indices]


def unstarted(monkeypatch, attach=None, reward_model=False, relay_fanout=None, replay_shards=1) -> Supervisor:
    """A supervisor over ``FakeFactory`` with Ray faked; ``attach``: service name → live handle to re-attach."""
    fake_ray = SimpleNamespace(get=_get, kill=lambda h, no_restart=True: setattr(h, "killed", True),
                               wait=lambda refs, num_returns=1, timeout=0: (refs, []),
                               exceptions=sup_mod.ray.exceptions)
    monkeypatch.setattr(sup_mod, "ray", fake_ray)
    monkeypatch.setattr(relay_tree, "ray", fake_ray)
    monkeypatch.setattr(health, "ray", fake_ray)
    monkeypatch.setattr(drains, "ray", fake_ray)
    monkeypatch.setattr(health, "check_health", lambda address, timeout_s, security=None: True)
    state = FleetRequests("r", "gyre", 1)
    s = Supervisor(FakeFactory(relay_fanout, replay_shards), FakeHandle("state", take_requests=state.take_requests, publish=state.publish,
                                                 finish_reward_swap=state.finish_reward_swap))
    s.factory.with_reward_model = reward_model
    s.factory.attach = lambda name: (attach or {}).get(name)
    s.state_body = state
    return s


@pytest.fixture
def sup(monkeypatch):
    s = unstarted(monkeypatch)
    s.start(1)
    s.learner.info = learner_info()
    return s


PUSH_METHODS = {topology.endpoint(server).push_method for server in topology.servers()}


def pushes(handles) -> set[tuple[str, str, tuple]]:
    """``(actor, method, args)`` of every address push the handles received."""
    return {(h.name, method, args) for h in handles for method, args in h.calls if method in PUSH_METHODS}
