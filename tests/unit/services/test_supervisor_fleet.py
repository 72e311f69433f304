"""The supervisor at fleet size, with the actor doubles of ``test_ops_supervisor`` (no Ray): one health round for
every service under one deadline, a rollout Ray cannot place given up by name, scale-in drained in the background
while the ticks go on."""

from gyre.services.control.orchestration import supervisor as sup_mod
from tests.unit.services.supervisor_fakes import _health_round, sup  # noqa: F401  (the fixture)


def test_a_round_asks_every_service_at_once_under_one_deadline(sup, monkeypatch):
    """Asked one after another (each with its own ``check_timeout_s``), a fleet of hung rollouts held the tick for
    one deadline per rollout, and health checks and metrics stopped meanwhile."""
    sup.state_body.request_scale("rollout", 4)
    sup.tick()
    assert len(sup.rollouts()) == 4
    waits = []

    hung = sup.rollouts()[1].handle

    def wait(refs, num_returns=1, timeout=0):  # rollout-1 does not answer within the deadline
        waits.append((len(refs), num_returns, timeout))
        return [r for r in refs if r.owner is not hung], [r for r in refs if r.owner is hung]
    monkeypatch.setattr(sup_mod.ray, "wait", wait)
    sup.tick()
    assert waits == [(6, 6, sup.check_timeout_s)]  # replay, learner, 4 rollouts: one wait, one deadline
    assert [s.failures for s in sup.rollouts()] == [0, 1, 0, 0]


def test_a_rollout_that_never_starts_is_given_up_by_name_after_the_start_timeout(sup, monkeypatch):
    """Ray could not place it (or its setup hangs): before, it stayed "starting" for ever and held its slot."""
    monkeypatch.setattr(sup_mod.ray, "wait", lambda refs, num_returns=1, timeout=0: (refs, []) if _health_round(refs)
                        else ([], refs))  # the setup never returns
    sup.start_timeout_s = 60.0
    sup.state_body.request_scale("rollout", 2)
    sup.tick()
    assert list(sup.starting) == ["rollout-1"]
    sup.starting["rollout-1"].since -= 61.0
    sup.tick()
    assert "rollout-1" not in sup.services and sup.deaths[-1].service == "rollout-1"
    assert sup.deaths[-1].reason == "not started in time"
    sup.tick()  # the next scale tries again, with a new incarnation
    assert list(sup.starting) == ["rollout-1"] and sup.starting["rollout-1"].incarnation == 1


def test_scale_in_drains_in_the_background_while_the_ticks_go_on(sup, monkeypatch):
    """A blocking drain held the supervisor (health checks, metrics, other requests) up to 150 s per rollout."""
    sup.generating = True
    sup.state_body.request_scale("rollout", 3)
    sup.tick()
    leaving = sup.services["rollout-2"].handle
    monkeypatch.setattr(sup_mod.ray, "wait", lambda refs, num_returns=1, timeout=0: (refs, []) if _health_round(refs)
                        else ([], refs))  # the drain takes long
    sup.state_body.request_scale("rollout", 2)
    sup.tick()
    sup.tick()
    assert list(sup.draining) == ["rollout-2"] and not leaving.killed
    assert sorted(s.name for s in sup.rollouts()) == ["rollout-0", "rollout-1"]
    checks = sum(c[0] == "describe" for c in sup.services["rollout-0"].handle.calls)
    sup.tick()
    assert sum(c[0] == "describe" for c in sup.services["rollout-0"].handle.calls) == checks + 1  # still checked
    sup.state_body.request_scale("rollout", 3)  # grows again meanwhile: a new name, not the draining one's
    sup.tick()
    assert "rollout-3" in sup.starting or "rollout-3" in sup.services
    sup.draining["rollout-2"].deadline = 0.0  # the drain outlived its deadline: killed
    sup.tick()
    assert leaving.killed and not sup.draining
