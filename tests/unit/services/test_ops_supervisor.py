"""Supervisor decisions with hand-written actor doubles (no Ray): when a service is restarted, what the
restart pushes to its clients, how restarts are counted, and how the rollout fleet scales."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from ray.exceptions import GetTimeoutError, RayActorError

from services.control import supervisor as sup_mod
from services.control.ops import FleetRequests
from services.control.supervisor import Service, Supervisor


class Call:
    """What ``handle.method.remote(...)`` returns here: resolved by the fake ``ray.get``."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args


class FakeHandle:
    """An actor double: ``handle.name.remote(*args)`` calls ``behaviour[name](*args)`` when resolved."""

    def __init__(self, name: str, **behaviour):
        self.name, self.calls, self.killed = name, [], False
        self.behaviour = {"describe": lambda: {"pid": 1, "node": "n", "version": 0}, **behaviour}

    def __getattr__(self, method):
        def remote(*args):
            self.calls.append((method, args))
            return Call(lambda *a: self._run(method, *a), args)
        return SimpleNamespace(remote=remote)

    def _run(self, method, *args):
        if self.killed:
            raise RayActorError()
        fn = self.behaviour.get(method)
        return fn(*args) if fn is not None else None


def _get(x, timeout=None):
    if isinstance(x, list):
        return [_get(i) for i in x]
    return x.fn(*x.args) if isinstance(x, Call) else x


class FakeFactory:
    def __init__(self):
        self.made = {"replay": 0, "learner": 0, "rollout": 0}
        self.recipe = SimpleNamespace(security=None)
        self.log_dir = Path("/runs/r/logs")

    def replay(self):
        self.made["replay"] += 1
        return Service("replay", "replay", FakeHandle("replay"), f"replay:{self.made['replay']}")

    def learner(self, replay_address, restarted=False):
        self.made["learner"] += 1
        handle = FakeHandle("learner", describe=lambda: {"pid": 2, "version": 5})
        return Service("learner", "learner", handle, f"weights:{self.made['learner']}")

    def attach_followers(self):
        return []

    def begin_rollout(self, index, replay_address, weights_address):
        self.made["rollout"] += 1
        handle = FakeHandle(f"rollout-{index}", describe=lambda: {"pid": 10 + index, "version": 5})
        return handle, handle.setup.remote()

    def rollouts(self, indices, replay_address, weights_address):
        return [Service(f"rollout-{i}", "rollout", self.begin_rollout(i, replay_address, weights_address)[0], None)
                for i in indices]


@pytest.fixture
def sup(monkeypatch):
    fake_ray = SimpleNamespace(get=_get, kill=lambda h, no_restart=True: setattr(h, "killed", True),
                               wait=lambda refs, timeout=0: (refs, []), exceptions=sup_mod.ray.exceptions)
    monkeypatch.setattr(sup_mod, "ray", fake_ray)
    monkeypatch.setattr(sup_mod, "check_health", lambda address, timeout_s, security=None: True)
    state = FleetRequests("r", "gyre", 1)
    s = Supervisor(FakeFactory(), FakeHandle("state", take_requests=state.take_requests, publish=state.publish))
    s.factory.attach = lambda name: None
    s.start(1)
    s.learner.info = {"version": 5}
    s.state_body = state
    return s


def test_dead_actor_is_restarted_at_once_and_its_address_pushed(sup):
    old_replay = sup.replay.handle
    old_replay.killed = True  # the process is gone: describe raises RayActorError
    sup.tick()
    assert sup.replay.restarts == 1 and sup.replay.address == "replay:2" and sup.factory.made["replay"] == 2
    assert ("set_replay_address", ("replay:2",)) in sup.learner.handle.calls
    assert ("set_replay_address", ("replay:2",)) in sup.rollouts()[0].handle.calls
    assert sup.state_body.status()["restarts"] == {"replay": 1, "learner": 0, "rollout-0": 0}
    assert sup.state_body.status()["logs"] == "/runs/r/logs"  # where `gyre status` says the log files are


def test_a_dead_learner_rank_restarts_every_rank_of_the_group(sup):
    follower = FakeHandle("learner-rank-1", describe=lambda: {"pid": 3, "rank": 1})
    sup.learner.followers = [follower]
    old = sup.learner.handle
    sup.tick()
    assert sup.learner.restarts == 0  # a live follower: nothing to do
    follower.killed = True  # rank 1's process is gone; rank 0 still answers
    sup.tick()
    assert old.killed and follower.killed  # DeepSpeed groups restart whole
    assert sup.learner.restarts == 1 and sup.learner_generation == 1 and sup.factory.made["learner"] == 2
    assert ("set_weights_address", ("weights:2",)) in sup.rollouts()[0].handle.calls


def test_hung_service_is_restarted_after_fail_threshold_checks(sup):
    def hung():
        raise GetTimeoutError()

    sup.learner.handle.behaviour["describe"] = hung
    for expected_failures in (1, 2):
        sup.tick()
        assert sup.learner.failures == expected_failures and sup.learner_generation == 0
    sup.tick()  # third failed check: killed and recreated, weights address pushed, run re-issued by _train
    assert sup.learner.restarts == 1 and sup.learner_generation == 1 and sup.factory.made["learner"] == 2
    assert ("set_weights_address", ("weights:2",)) in sup.rollouts()[0].handle.calls


def test_failed_grpc_health_counts_as_a_failed_check(sup, monkeypatch):
    monkeypatch.setattr(sup_mod, "check_health", lambda address, timeout_s, security=None: address != "replay:1")
    sup.tick()
    sup.tick()
    assert sup.replay.failures == 2 and sup.replay.restarts == 0
    sup.tick()
    assert sup.replay.restarts == 1 and sup.replay.failures == 0


def test_scale_out_adopts_bootstrapped_rollouts_and_scale_in_drains_the_newest(sup):
    sup.generating = True
    sup.state_body.request_scale("rollout", 3)
    sup.tick()
    assert sorted(s.name for s in sup.rollouts()) == ["rollout-0", "rollout-1", "rollout-2"]
    new = sup.services["rollout-2"].handle
    # set up, told the current addresses, found at the learner's version, then generating
    assert [c[0] for c in new.calls] == ["setup", "set_replay_address", "set_weights_address", "describe", "start"]
    sup.state_body.request_scale("rollout", 1)
    sup.tick()
    assert [s.name for s in sup.rollouts()] == ["rollout-0"] and new.killed
    assert [c[0] for c in new.calls][-2:] == ["drain", "stop"]


def test_a_rollout_behind_the_learner_waits_before_generating(sup):
    sup.generating = True
    sup.state_body.request_scale("rollout", 2)
    versions = iter([3, 5, 5])
    handle = FakeHandle("rollout-1", describe=lambda: {"pid": 7, "version": next(versions)})
    sup.factory.begin_rollout = lambda i, r, w: (handle, handle.setup.remote())
    sup.tick()
    assert "rollout-1" in sup.starting and [s.name for s in sup.rollouts()] == ["rollout-0"]
    sup.tick()
    assert not sup.starting and ("start", ()) in sup.services["rollout-1"].handle.calls


def test_a_restart_whose_new_incarnation_dies_while_starting_is_retried_next_tick(sup):
    sup.rollouts()[0].handle.killed = True
    make = sup.factory.begin_rollout
    attempts = []

    def dies_in_setup(index, replay_address, weights_address):
        handle, _ = make(index, replay_address, weights_address)
        attempts.append(handle)
        if len(attempts) == 1:
            handle.killed = True  # the new process dies before setup returned (e.g. a fault point)
        return handle, handle.setup.remote()

    sup.factory.begin_rollout = dies_in_setup
    sup.tick()  # the failed restart is logged, not raised; the dead entry stays
    assert [s.name for s in sup.rollouts()] == ["rollout-0"] and sup.rollouts()[0].restarts == 0
    sup.tick()
    assert len(attempts) == 2 and sup.rollouts()[0].handle is attempts[1] and sup.rollouts()[0].restarts == 1


def test_a_rollout_restart_does_not_hold_up_the_tick(sup, monkeypatch):
    """A rollout's replacement starts its engine in the background (tens of seconds with vLLM): the
    ticks meanwhile still check and restart the other services, and scaling does not count the
    restarting rollout twice; the replacement joins, counted as a restart, once it is up."""
    sup.generating = True
    ready = {"setup": False}
    monkeypatch.setattr(sup_mod.ray, "wait", lambda refs, timeout=0: (refs, []) if ready["setup"] else ([], refs))
    old = sup.rollouts()[0].handle
    old.killed = True
    sup.tick()
    assert "rollout-0" in sup.starting and sup.factory.made["rollout"] == 2
    rows = {r["name"]: r for r in sup.state_body.status()["services"]}
    assert rows["rollout-0"]["starting"] and rows["rollout-0"]["restarts"] == 1
    sup.replay.handle.killed = True  # replay dies while the rollout is still starting
    sup.state_body.request_scale("rollout", 1)  # the fleet already has one (being restarted)
    sup.tick()
    assert sup.replay.restarts == 1 and sup.factory.made["replay"] == 2
    assert sup.factory.made["rollout"] == 2 and list(sup.starting) == ["rollout-0"]  # no second start, no extra
    ready["setup"] = True
    sup.tick()
    new = sup.rollouts()[0]
    assert not sup.starting and new.handle is not old and new.restarts == 1
    assert ("set_replay_address", ("replay:2",)) in new.handle.calls and ("start", ()) in new.handle.calls


def test_restarting_a_rollout_again_while_it_starts_replaces_the_pending_start(sup, monkeypatch):
    monkeypatch.setattr(sup_mod.ray, "wait", lambda refs, timeout=0: ([], refs))  # setups never return here
    sup.rollouts()[0].handle.killed = True
    sup.tick()
    first = sup.starting["rollout-0"].handle
    sup.restart(sup.rollouts()[0], reason="requested")
    assert first.killed and sup.starting["rollout-0"].handle is not first and len(sup.starting) == 1
