"""The one way a replay connection is re-pointed after a replay restart (``ReplayLink.reroute``): the rollout's
``set_replay_address`` goes through it like the learner's, keeping what the link tracks."""

import asyncio
from types import SimpleNamespace

from services.replay.links import ReroutableReplay, TrackedReplay
from services.rollout.actor import RolloutActor


class Client(SimpleNamespace):
    def lease_prompts(self, consumer, count, ttl_s=0.0, below=0):
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
