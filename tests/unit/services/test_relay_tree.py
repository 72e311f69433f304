"""The supervisor's relay tree (``weight_transport.relay_fanout``, ``services.control.orchestration.relay_tree``)
with the actor doubles of ``test_ops_supervisor``: who each rollout fetches weights from, across restarts."""

from gyre.services.control.orchestration import relay_tree
from tests.unit.services.supervisor_fakes import learner_info, sup, unstarted  # noqa: F401  (sup: a fixture)


def _upstreams_told(svc):
    return [args[0] for method, args in svc.handle.calls if method == "set_relay_upstreams"]


def test_relay_fanout_points_each_rollout_at_its_running_ancestors_and_follows_restarts(monkeypatch):
    """fanout 2: rollout 1 and 2 under 0, 3 and 4 under 1. A restarting relay's children skip to its parent until
    its replacement joins with a new address; nobody is told twice the same thing."""
    sup = unstarted(monkeypatch, relay_fanout=2)
    sup.start(1)
    sup.learner.info = learner_info()
    sup.state_body.request_scale("rollout", 5)
    sup.tick()
    told = {s.id.index: _upstreams_told(s) for s in sup.rollouts()}
    relay = {s.id.index: s.info.relay_address for s in sup.rollouts()}
    assert told == {0: [[]], 1: [[relay[0]]], 2: [[relay[0]]], 3: [[relay[1], relay[0]]], 4: [[relay[1], relay[0]]]}
    sup.tick()
    assert {s.id.index: len(_upstreams_told(s)) for s in sup.rollouts()} == {i: 1 for i in range(5)}
    sup.services["rollout-1"].handle.killed = True
    sup.tick()  # rollout-1 restarted; its replacement joined in the same tick here
    new = sup.services["rollout-1"].info.relay_address
    assert new != relay[1] and _upstreams_told(sup.services["rollout-3"])[-1] == [new, relay[0]]
    assert _upstreams_told(sup.services["rollout-1"])[-1] == [relay[0]]


def test_a_missing_or_relayless_ancestor_is_skipped():
    """While rollout 1 restarts (not running) or serves no relay, 3 and 4 fetch from rollout 0's relay."""
    assert relay_tree.relay_upstreams({0: "a:1", 2: "b:1", 3: None, 4: "d:1"}, fanout=2) == {
        0: [], 2: ["a:1"], 3: ["a:1"], 4: ["a:1"]}
    assert relay_tree.relay_upstreams({0: "a:1", 1: None, 3: "c:1"}, fanout=2) == {0: [], 1: ["a:1"], 3: ["a:1"]}


def test_without_relay_fanout_no_rollout_is_told_about_relays(sup):
    sup.tick()
    assert _upstreams_told(sup.rollouts()[0]) == []
