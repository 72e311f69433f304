"""Which relays each rollout fetches weights from (``weight_transport.relay_fanout``), and telling it.

The tree is ``services.rollout.transport.relay.relay_parent``'s over rollout indices; a rollout's upstreams are its
ancestors that are running now and serve a relay, nearest first (the learner, last, is the rollout's own
``set_weights_address``). So a dead or removed relay's children skip to its parent, a restarted one is picked up
again with its new address, and a joining rollout enters the tree on the tick it joins. The supervisor calls
``RelayTree.update`` once per tick; a rollout is told only when its upstreams changed.
"""

from __future__ import annotations

import ray
import structlog
from ray.exceptions import GetTimeoutError, RayActorError

from gyre.services.rollout.transport.relay import relay_ancestors

log = structlog.get_logger("supervisor")


def relay_upstreams(relays: dict[int, str | None], fanout: int) -> dict[int, list[str]]:
    """Rollout index → the relay addresses it fetches from, nearest first, given ``relays``: each running rollout's
    index → its relay's address (``None``: it serves none)."""
    return {i: [relays[a] for a in relay_ancestors(i, fanout) if relays.get(a)] for i in relays}


class RelayTree:
    """Pushes each running rollout's relay upstreams (``RolloutActor.set_relay_upstreams``) when they change.

    Args:
        fanout: ``weight_transport.relay_fanout`` (``None``: no relays; ``update`` does nothing).
        timeout_s: seconds one push may take.
    """

    def __init__(self, fanout: int | None, timeout_s: float = 30.0) -> None:
        self.fanout, self.timeout_s = fanout, timeout_s
        self.told: dict[tuple[str, int], tuple[str, ...]] = {}
        """``(service name, incarnation)`` → the upstreams it was last told."""

    def update(self, rollouts: list) -> int:
        """Tell every rollout in ``rollouts`` (running ``Service`` entries with their last ``describe``) whose relay
        upstreams changed; returns how many were told. A rollout that cannot be reached is told again next tick."""
        if self.fanout is None:
            return 0
        known = [s for s in rollouts if s.info is not None]
        want = relay_upstreams({s.id.index: getattr(s.info, "relay_address", None) for s in known}, self.fanout)
        pushes = []
        for svc in known:
            key, ups = (svc.name, svc.incarnation), tuple(want[svc.id.index])
            if self.told.get(key) != ups:
                pushes.append((key, ups, svc.handle.set_relay_upstreams.remote(list(ups))))
        for key, ups, ref in pushes:
            try:
                ray.get(ref, timeout=self.timeout_s)
            except (RayActorError, GetTimeoutError) as exc:
                log.warning("relay_upstreams_push_failed", service=key[0], error=str(exc)[:200])
                continue
            self.told[key] = ups
            log.info("relay_upstreams", service=key[0], upstreams=list(ups))
        live = {(s.name, s.incarnation) for s in rollouts}
        self.told = {k: v for k, v in self.told.items() if k in live}
        return len(pushes)
