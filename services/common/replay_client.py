"""Client of ``ReplayService`` used by rollout services and the learner."""

from __future__ import annotations

import functools
import itertools

import grpc
import pyarrow as pa

from gyre.proto import replay_pb2, replay_pb2_grpc
from gyre.proto.trajectory import SCHEMA_VERSION, TRAJECTORY_SCHEMA, read_stream, to_ipc, validate_table
from gyre.services.common import grpc_common
from gyre.services.common.security import SecurityConfig


TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""Statuses after which the same call may simply be retried: replay down or restarting, too slow, or
holding inserts back for its rate limiter."""


class ReplayUnavailableError(ConnectionError):
    """Replay did not answer (down, restarting, overloaded or rate limited); the call may be retried."""


def _transient_as_connection_error(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except grpc.RpcError as exc:
            if exc.code() in TRANSIENT:
                raise ReplayUnavailableError(f"replay at {self.address}: {exc.code().name}: {exc.details()}") from exc
            raise
    return wrapper


class ReplayClient:
    """Blocking calls with deadlines (seconds).

    Raises ``ReplayUnavailableError`` (a ``ConnectionError``) when replay is unreachable or times out;
    any other gRPC status (INVALID_ARGUMENT, NOT_FOUND) propagates as ``grpc.RpcError``.
    """

    def __init__(self, address: str, timeout_s: float = 30.0, security: SecurityConfig | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc_common.channel(address, security)
        self._stub = replay_pb2_grpc.ReplayServiceStub(self._channel)
        self._batch_ids = itertools.count()

    @_transient_as_connection_error
    def insert(self, table: pa.Table) -> replay_pb2.InsertResponse:
        """Insert whole groups; returns once replay acknowledged them. Safe to retry (ids dedupe)."""
        req = replay_pb2.InsertRequest(schema_version=SCHEMA_VERSION, batch_id=next(self._batch_ids),
                                       arrow_ipc=to_ipc(table))
        responses = self._stub.Insert(iter([req]), timeout=self.timeout_s)
        return next(iter(responses))

    @_transient_as_connection_error
    def sample(self, num_groups: int, learner_version: int, timeout_s: float, consumer: str = "",
               prompt_indices: list[int] | None = None, request_id: str = "") -> tuple[str, pa.Table] | None:
        """Lease ``num_groups`` whole groups, waiting up to ``timeout_s``; ``None`` if none ready.
        ``prompt_indices``: exactly those prompts' groups, in that order (lockstep). ``request_id``: the
        idempotency key of this logical sample; pass the same one when retrying after a
        ``ReplayUnavailableError`` and a lease whose answer was lost comes back instead of a second one."""
        stream = self._stub.SampleStream(
            replay_pb2.SampleRequest(schema_version=SCHEMA_VERSION, num_groups=num_groups,
                                     learner_version=learner_version, timeout_s=timeout_s, consumer=consumer,
                                     prompt_indices=prompt_indices or [], request_id=request_id),
            timeout=timeout_s + self.timeout_s)
        head = next(stream, None)  # the lease; then the batch's rows in slices (no cap on the batch's size)
        if head is None or not head.lease_id:
            return None
        parts = [read_stream(m.arrow_ipc, "a SampleStream slice") for m in stream]
        table = pa.concat_tables(parts) if parts else TRAJECTORY_SCHEMA.empty_table()
        validate_table(table)
        return head.lease_id, table

    @_transient_as_connection_error
    def ack(self, lease_ids: list[str]) -> int:
        return self._stub.Ack(replay_pb2.AckRequest(lease_ids=lease_ids), timeout=self.timeout_s).acked

    @_transient_as_connection_error
    def release(self, lease_ids: list[str]) -> int:
        return self._stub.Release(replay_pb2.ReleaseRequest(lease_ids=lease_ids), timeout=self.timeout_s).released

    @_transient_as_connection_error
    def rejoin(self, consumer: str, learner_version: int, timeline: int = 0) -> int:
        """Release every lease ``consumer`` holds and set replay's learner version and timeline (see ``Rejoin``)."""
        return self._stub.Rejoin(replay_pb2.RejoinRequest(consumer=consumer, learner_version=learner_version,
                                                          timeline=timeline), timeout=self.timeout_s).released

    @_transient_as_connection_error
    def lease_prompts(self, consumer: str, count: int, ttl_s: float = 0.0, below: int = 0,
                      max_ready: int = 0, policy_version: int | None = None) -> list[tuple[int, int]]:
        """``[(prompt_index, attempt)]``, up to ``count``: fewer or none when replay's work budget is spent or
        ``max_ready`` > 0 groups are ready; ``ttl_s`` 0 uses the server's default; ``below`` > 0: only indices
        under it (lockstep); ``policy_version``: the rollout's weights (the budget counts their lag)."""
        resp = self._stub.LeasePrompts(
            replay_pb2.LeasePromptsRequest(consumer=consumer, count=count, ttl_s=ttl_s, below_prompt_index=below,
                                           max_ready_groups=max_ready, policy_version=policy_version),
            timeout=self.timeout_s)
        return [(p.prompt_index, p.attempt) for p in resp.prompts]

    @_transient_as_connection_error
    def update_priorities(self, group_ids: list[str], priorities: list[float]) -> tuple[int, list[str]]:
        """Set sampling priorities; returns ``(updated, unknown group ids)``."""
        resp = self._stub.UpdatePriorities(
            replay_pb2.UpdatePrioritiesRequest(group_ids=group_ids, priorities=priorities), timeout=self.timeout_s)
        return resp.updated, list(resp.unknown_group_ids)

    @_transient_as_connection_error
    def snapshot(self) -> str:
        """Ask replay to write a snapshot now; returns its directory ("" if nothing changed)."""
        return self._stub.Snapshot(replay_pb2.SnapshotRequest(), timeout=max(self.timeout_s, 300.0)).path

    @_transient_as_connection_error
    def info(self) -> replay_pb2.InfoResponse:
        return self._stub.Info(replay_pb2.InfoRequest(), timeout=self.timeout_s)

    def close(self) -> None:
        self._channel.close()
