"""The learner's and the rollouts' replay connections, re-pointable after a replay restart.

The supervisor pushes a restarted replay's new address (``set_replay_address`` on each actor, which calls
``ReplayLink.reroute``: the one way a replay connection is re-pointed); these wrappers make every call look
the client up afresh, so a call that failed against the dead server is retried against the new one.
"""

from __future__ import annotations

import time
from typing import Callable

import pyarrow as pa
import structlog
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

log = structlog.get_logger("actors")
OUTAGE_POLL_S = 1.0
"""Seconds between the tries of an ``ack`` or ``rejoin`` waiting out a replay outage."""


def replay_connector(security=None) -> Callable[[str], object]:
    """``address -> client`` with ``security`` (a ``SecurityConfig`` or ``None``: plaintext): a ``ReplayClient``, or a
    ``ShardedReplayClient`` for a sharded replay's address (``services.common.replay_shards.connect_replay``)."""
    from gyre.services.common.replay_shards import connect_replay

    return lambda address: connect_replay(address, security=security)


class ReplayLink:
    """A replay connection the supervisor can re-point after a replay restart (``reroute``).

    Args:
        client: the ``ReplayClient`` (or a test double with ``address``) used until the first reroute.
        connect: ``address -> client`` for a rerouted address (``replay_connector``).
    """

    def __init__(self, client, connect: Callable[[str], object]) -> None:
        self.client, self._connect = client, connect

    @property
    def address(self) -> str:
        return self.client.address

    def reroute(self, address: str) -> None:
        """Use ``address`` from the next call on (the old channel is left to close on its own so a call
        in flight on it fails as UNAVAILABLE and is retried, never as a closed-channel error)."""
        if address != self.client.address:
            self.client = self._connect(address)


class ReroutableReplay(ReplayLink):
    """The learner's replay connection: a ``ReplayClient`` the supervisor can re-point after a replay
    restart (``reroute``). ``ack`` (after a checkpoint commit) and ``rejoin`` (on resume) wait out a replay outage, retrying for up
    to ``ack_patience_s`` seconds, since failing it would fail the whole step; acks are idempotent per
    lease (leases are in replay's WAL, so they survive its restart). Other calls pass straight through
    (the loop already retries ``sample`` on ``ConnectionError``)."""

    def __init__(self, address: str, security=None, ack_patience_s: float = 300.0) -> None:
        connect = replay_connector(security)
        super().__init__(connect(address), connect)
        self.security = security
        self.ack_patience_s = ack_patience_s

    def sample(self, *args, **kwargs):
        return self.client.sample(*args, **kwargs)

    def info(self):
        return self.client.info()

    def ack(self, lease_ids: list[str]) -> int:
        return self._patiently(lambda: self.client.ack(lease_ids))

    def rejoin(self, consumer: str, learner_version: int, timeline: int = 0) -> int:
        return self._patiently(lambda: self.client.rejoin(consumer, learner_version, timeline))

    def _patiently(self, call):
        """``call()``, again every ``OUTAGE_POLL_S`` seconds while it raises ``ConnectionError`` (replay
        restarting: the supervisor will reroute us), each logged (``ack_waiting_for_replay``); raises the last
        ``ConnectionError`` once ``ack_patience_s`` seconds passed, any other error at once."""
        retrying = Retrying(retry=retry_if_exception_type(ConnectionError), wait=wait_fixed(OUTAGE_POLL_S),
                            stop=stop_after_delay(self.ack_patience_s), reraise=True,
                            before_sleep=lambda state: log.warning(
                                "ack_waiting_for_replay", error=str(state.outcome.exception())[:200]))
        return retrying(call)


def acked_event(table: pa.Table, resp) -> dict:
    """The rollout journal's ``acked`` event (``proto.journal``) for an insert of ``table`` that replay
    answered with ``resp`` (``InsertResponse`` or ``InsertResult``: accepted/duplicates/dropped_stale rows).

    Each group's ``status`` is what happened to it: ``accepted``, ``duplicate`` or ``dropped_stale`` when
    the response's row counts say so unambiguously (always for one group per insert, as rollouts send),
    else ``mixed``. ``newest_version`` is the newest policy version in the group's version spans."""
    accepted, dup, stale = int(resp.accepted), int(resp.duplicates), int(resp.dropped_stale)
    groups: dict[str, dict] = {}
    for gid, prompt, versions in zip(table.column("group_id").to_pylist(), table.column("prompt_index").to_pylist(),
                                     table.column("version_span_versions").to_pylist()):
        g = groups.setdefault(gid, {"group_id": gid, "prompt_index": prompt, "rows": 0, "newest_version": -1})
        g["rows"] += 1
        g["newest_version"] = max([g["newest_version"], *versions])
    total = table.num_rows
    status = ("accepted" if accepted == total else "duplicate" if dup == total
              else "dropped_stale" if stale == total else "mixed")
    for g in groups.values():
        g["status"] = status
    return {"event": "acked", "groups": list(groups.values()), "accepted": accepted, "duplicates": dup,
            "dropped_stale": stale, "time": time.time()}


class TrackedReplay(ReplayLink):
    """A rollout's replay connection: remembers the prompt indices leased and not yet delivered, and can
    stop leasing (``draining``) so a rollout being removed finishes what it holds instead of dropping it.
    Re-pointed by ``reroute`` after a replay restart, like the learner's (each call reads ``client`` afresh).
    With a ``journal`` (``proto.journal.Journal``) every acknowledged insert is journaled (``acked_event``)."""

    def __init__(self, client, journal=None, *, connect: Callable[[str], object]) -> None:
        super().__init__(client, connect)
        self.journal = journal
        self.outstanding: set[int] = set()
        """Prompt indices leased to this rollout whose group replay has not acknowledged yet."""
        self.draining = False

    def lease_prompts(self, consumer: str, count: int, ttl_s: float = 0.0, below: int = 0,
                      max_ready: int = 0, policy_version: int | None = None) -> list[tuple[int, int]]:
        if self.draining:
            return []
        got = self.client.lease_prompts(consumer, count, ttl_s, below, max_ready, policy_version)
        self.outstanding.update(p for p, _ in got)
        return got

    def insert(self, table):
        resp = self.client.insert(table)
        self.outstanding.difference_update(table.column("prompt_index").to_pylist())
        if self.journal is not None:
            self.journal.append(acked_event(table, resp))
        return resp

    def info(self):
        return self.client.info()
