"""``services.common.replay_links``: the one way a replay connection is re-pointed after a replay restart
(``ReplayLink.reroute``: the rollout's ``set_replay_address`` goes through it like the learner's, keeping what the
link tracks), and ``ReroutableReplay``'s ``ack`` and ``rejoin`` waiting out a replay outage, then giving up."""

import asyncio
from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

from gyre.services.common import replay_links as links
from gyre.services.common.replay_links import ReroutableReplay, TrackedReplay
from gyre.services.rollout.actor import RolloutActor


class Client(SimpleNamespace):
    def lease_prompts(self, consumer, count, ttl_s=0.0, below=0, max_ready=0, policy_version=None):
        return [(7, 0)]


def test_a_rollouts_set_replay_address_reroutes_its_link_and_keeps_its_outstanding_leases():
    dialled = []
    link = TrackedReplay(Client(address="replay:1"), connect=lambda a: dialled.append(a) or Client(address=a))
    link.lease_prompts("rollout-0", 1)
    actor = RolloutActor.__ray_actor_class__.__new__(RolloutActor.__ray_actor_class__)
    actor.replay, actor.security = link, None
    asyncio.run(actor.set_replay_address("replay:1"))  # the same address: no new client
    asyncio.run(actor.set_replay_address("replay:2"))
    assert actor.replay is link and dialled == ["replay:2"] and link.address == "replay:2"
    assert link.outstanding == {7}


def test_the_learners_link_reroutes_the_same_way():
    link = ReroutableReplay("127.0.0.1:1")
    first = link.client
    link.reroute("127.0.0.1:1")
    assert link.client is first
    link.reroute("127.0.0.1:2")
    assert link.address == "127.0.0.1:2" and link.client is not first


class _Outage:
    """A replay client whose first ``failures`` calls of ``ack``/``rejoin`` raise ``error``; later ones answer 7."""

    address = "127.0.0.1:1"

    def __init__(self, failures: int, error: type[Exception] = ConnectionError) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def _call(self, *args):
        self.calls += 1
        if self.calls > 1000:
            raise RuntimeError("still retrying after 1000 calls")
        if self.calls <= self.failures:
            raise self.error("scripted")
        return 7

    ack = rejoin = _call


def _replay(client: _Outage, patience_s: float = 300.0) -> links.ReroutableReplay:
    replay = links.ReroutableReplay(client.address, ack_patience_s=patience_s)
    replay.client = client
    return replay


def test_ack_and_rejoin_wait_out_an_outage_polling_and_logging(monkeypatch):
    monkeypatch.setattr(links, "OUTAGE_POLL_S", 0.01)
    client = _Outage(failures=2)
    with capture_logs() as logs:
        assert _replay(client).ack(["lease-1"]) == 7
    assert client.calls == 3 and [e["event"] for e in logs] == ["ack_waiting_for_replay"] * 2
    client = _Outage(failures=1)
    assert _replay(client).rejoin("learner", 3) == 7 and client.calls == 2


def test_ack_raises_the_outage_after_its_patience_and_other_errors_at_once(monkeypatch):
    monkeypatch.setattr(links, "OUTAGE_POLL_S", 0.01)
    client = _Outage(failures=10**9)  # down for good
    with pytest.raises(ConnectionError, match="scripted"):
        _replay(client, patience_s=0.1).ack(["lease-1"])
    assert client.calls >= 2  # it did wait: more than one try
    client = _Outage(failures=10**9, error=ValueError)
    with pytest.raises(ValueError, match="scripted"):
        _replay(client).ack(["lease-1"])
    assert client.calls == 1
