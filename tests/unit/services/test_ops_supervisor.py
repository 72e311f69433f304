"""Supervisor decisions with hand-written actor doubles (no Ray): when a service is restarted, what the
restart pushes to its clients, how restarts are counted, and how the rollout fleet scales."""

import inspect

import pytest
from ray.exceptions import GetTimeoutError, RayActorError

from gyre.services.common.names import ROLES
from gyre.services.common.service_info import LearnerRankInfo
from gyre.services.control.commands import ops
from gyre.services.control.orchestration import supervisor as sup_mod
from gyre.services.control.orchestration import health, topology
from gyre.services.learner.actor import LearnerActor
from gyre.services.replay.actor import ReplayActor
from gyre.services.reward_model.actor import RewardModelActor
from gyre.services.rollout.actor import RolloutActor
from tests.unit.services.supervisor_fakes import (FakeHandle, _health_round, learner_info, pushes,  # noqa: F401
                                                  rollout_info, sup, unstarted)  # sup: a fixture


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
    follower = FakeHandle("learner-rank-1", describe=lambda: LearnerRankInfo(pid=3, node="n", rank=1, version=5,
                                                                             following=True))
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
    monkeypatch.setattr(health, "check_health", lambda address, timeout_s, security=None: address != "replay:1")
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
    assert set(sup.joined_s) == {"rollout-1", "rollout-2"} and all(s >= 0 for s in sup.joined_s.values())
    assert sup.status()["rollout_join_s"] == sup.joined_s  # `gyre scale` to generating, per rollout
    sup.state_body.request_scale("rollout", 1)
    sup.tick()  # out of the fleet at once; drained, then asked to stop
    assert [s.name for s in sup.rollouts()] == ["rollout-0"] and not new.killed
    assert [c[0] for c in new.calls][-2:] == ["drain", "stop"]
    sup.tick()  # stopped: killed
    assert new.killed and not sup.draining


def test_a_rollout_behind_the_learner_waits_before_generating(sup):
    sup.generating = True
    sup.state_body.request_scale("rollout", 2)
    versions = iter([3, 5, 5])
    handle = FakeHandle("rollout-1", describe=lambda: rollout_info(7, next(versions)))
    sup.factory.begin_rollout = lambda i, r, w, rm=None: (handle, handle.setup.remote())
    sup.tick()
    assert "rollout-1" in sup.starting and [s.name for s in sup.rollouts()] == ["rollout-0"]
    sup.tick()
    assert not sup.starting and ("start", ()) in sup.services["rollout-1"].handle.calls


def test_a_restart_whose_new_incarnation_dies_while_starting_is_retried_next_tick(sup):
    sup.rollouts()[0].handle.killed = True
    make = sup.factory.begin_rollout
    attempts = []

    def dies_in_setup(index, replay_address, weights_address, reward_model_address=None):
        handle, _ = make(index, replay_address, weights_address)
        attempts.append(handle)
        if len(attempts) == 1:
            handle.killed = True  # the new process dies before setup returned (e.g. a fault point)
        return handle, handle.setup.remote()

    sup.factory.begin_rollout = dies_in_setup
    sup.tick()  # the failed start is logged, not raised; the entry stands for the dead replacement
    assert [s.name for s in sup.rollouts()] == ["rollout-0"] and sup.rollouts()[0].restarts == 1
    sup.tick()
    sup.tick()
    # two deaths (the original and the replacement that died starting), two restarts: never folded into one
    assert len(attempts) == 2 and sup.rollouts()[0].handle is attempts[1] and sup.rollouts()[0].restarts == 2
    assert [(d.service, d.incarnation) for d in sup.deaths] == [("rollout-0", 0), ("rollout-0", 1)]
    assert sup.restart_counts()["rollout-0"] == 2


@pytest.mark.parametrize("when", ["in_constructor", "before_describe"])
def test_a_learner_replacement_that_dies_while_starting_is_a_death_and_a_restart_of_its_own(sup, when):
    """The crash matrix's 8-for-9 count: a restarted learner died again while its restart was in progress (in its
    constructor, or once serving, before the supervisor's ``describe`` answered, e.g. at ``publish.mid_stream``
    when the rollouts re-subscribed); it used to be folded into the previous death's restart."""
    make = sup.factory.learner

    def dies_once(replay_address, restarted=False):
        new = make(replay_address, restarted)
        if sup.factory.made["learner"] == 2:  # the first replacement (incarnation 1) dies
            new.handle.killed = True
            if when == "in_constructor":
                raise RayActorError()
        return new

    sup.factory.learner = dies_once
    sup.learner.handle.killed = True
    sup.tick()
    sup.tick()
    assert sup.factory.made["learner"] == 3 and sup.learner.incarnation == 2
    assert [(d.service, d.incarnation) for d in sup.deaths] == [("learner", 0), ("learner", 1)]
    assert sup.learner.restarts == 2 and sup.restart_counts()["learner"] == 2
    assert sup.state_body.status()["restarts"]["learner"] == 2


def test_a_rollout_restart_does_not_hold_up_the_tick(sup, monkeypatch):
    """A rollout's replacement starts its engine in the background (tens of seconds with vLLM): the
    ticks meanwhile still check and restart the other services, and scaling does not count the
    restarting rollout twice; the replacement joins, counted as a restart, once it is up."""
    sup.generating = True
    ready = {"setup": False}
    monkeypatch.setattr(sup_mod.ray, "wait", lambda refs, num_returns=1, timeout=0: (refs, []) if ready["setup"] or
                        _health_round(refs) else ([], refs))
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
    monkeypatch.setattr(sup_mod.ray, "wait", lambda refs, num_returns=1, timeout=0: (refs, []) if _health_round(refs)
                        else ([], refs))  # setups never return here
    sup.rollouts()[0].handle.killed = True
    sup.tick()
    first = sup.starting["rollout-0"].handle
    sup.restart(sup.rollouts()[0], reason="requested")
    assert first.killed and sup.starting["rollout-0"].handle is not first and len(sup.starting) == 1


# ---- the supervisor's wiring against the topology table (services.control.topology) ----------------------
@pytest.mark.parametrize("server", topology.servers())
def test_restarting_a_server_pushes_its_new_address_to_exactly_the_roles_that_dial_it(monkeypatch, server):
    sup = unstarted(monkeypatch, reward_model=True)
    sup.start(1)
    sup.learner.info = learner_info()
    sup.state_body.request_scale("rollout", 2)
    sup.tick()
    before = list(sup.services.values())
    for svc in before:
        svc.handle.calls.clear()
    old = sup.services[server].handle
    old.killed = True
    sup.tick()
    new = sup.services[server]
    assert new.restarts == 1 and new.handle is not old
    expected = {(c.name, topology.endpoint(server).push_method, (new.address,))
                for c in before if c.role in topology.clients_of(server)}
    assert len(expected) >= 2  # the learner and/or both rollouts: the check below cannot pass vacuously
    assert pushes([*(s.handle for s in before), new.handle]) == expected


@pytest.mark.parametrize("attached", [("learner",), ("replay",), ("replay", "learner")])
def test_a_reattached_service_is_told_the_addresses_it_dials_that_changed(monkeypatch, attached):
    """``start`` after a driver restart: a re-attached server is told each new server address it dials; a
    re-attached rollout every address it dials (it joins like a rollout that finished starting)."""
    live = {"replay": FakeHandle("replay", address=lambda: "replay:old"),
            "learner": FakeHandle("learner", describe=learner_info, weights_address=lambda: "weights:old"),
            "rollout-0": FakeHandle("rollout-0", describe=lambda: rollout_info(10))}
    s = unstarted(monkeypatch, attach={name: live[name] for name in [*attached, "rollout-0"]})
    assert s.start(1) == [*attached, "rollout-0"]
    expected = {(c, topology.endpoint(server).push_method, (s.services[server].address,))
                for c in [*attached, "rollout-0"] for server in topology.dialled_by(s.services[c].role)
                if server in s.services
                if c == "rollout-0" or server not in attached}
    assert pushes(live.values()) == expected
    assert ("rollout-0", "set_replay_address", ("replay:old" if "replay" in attached else "replay:1",)) in expected


def test_the_topology_names_the_actors_real_methods_and_address_arguments():
    """Each server actor answers its address by the table's method, each client actor takes a pushed address by
    the table's method, and each actor is created with exactly the address arguments of the servers it dials."""
    actors = {"replay": (ReplayActor, "__init__"), "learner": (LearnerActor, "__init__"),
              "rollout": (RolloutActor, "setup"), "reward_model": (RewardModelActor, "__init__")}
    assert set(actors) == set(topology.TOPOLOGY) == set(ROLES)
    for role, (actor, create) in actors.items():
        cls = actor.__ray_actor_class__
        address_args = {p for p in inspect.signature(getattr(cls, create)).parameters if p.endswith("_address")}
        assert address_args == {topology.endpoint(s).address_arg for s in topology.dialled_by(role)}, role
        for server in topology.dialled_by(role):
            assert callable(getattr(cls, topology.endpoint(server).push_method, None)), (role, server)
        if topology.TOPOLOGY[role].serves is not None:
            assert callable(getattr(cls, topology.endpoint(role).address_method, None)), role


def test_the_status_shows_the_reward_models_loaded(monkeypatch):
    sup = unstarted(monkeypatch, reward_model=True)
    sup.start(1)
    sup.tick()
    st = sup.state_body.status()
    assert st["reward_models"] == {"models": {"/m/rm": "rm:classifier:rm@abc"}, "counts": {"batches": 2}}
    assert "rm         rm:classifier:rm@abc loaded by reward_model" in ops.format_status(st).splitlines()
    assert st["restarts"]["reward_model"] == 0

