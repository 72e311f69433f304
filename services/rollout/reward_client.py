"""The rollout's way to the reward-model service (``rollout.rewards.model.Transport`` over gRPC).

A request is retried while the service is away — UNAVAILABLE (restarting, or no address yet), DEADLINE_EXCEEDED,
CANCELLED — until the reward's deadline (``timeout_s``), then every response of it gets reward 0.0 and
``reward_error = "timeout: ..."``. The rollout keeps generating meanwhile: scoring runs off its event loop
(``asyncio.to_thread``) and holds up only the groups waiting for it. A refusal (INVALID_ARGUMENT,
FAILED_PRECONDITION: a model that does not load) is recorded at once, not retried.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import structlog
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from gyre.proto import reward_model_pb2, reward_model_pb2_grpc
from gyre.rollout.rewards.base import RewardResult
from gyre.rollout.rewards.model import ModelSpec, ScoreItem
from gyre.services.common import grpc_common

log = structlog.get_logger("rollout.reward_client")
RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
ATTEMPT_S = 30.0
"""Longest single attempt (a batch waits behind others in the service's queue)."""


class _NoAddress(Exception):
    """No reward-model address was pushed yet."""


def _retried(exc: BaseException) -> bool:
    return isinstance(exc, _NoAddress) or (isinstance(exc, grpc.RpcError) and exc.code() in RETRIED)


class GrpcRewardModels:
    """``Transport`` to the ``RewardModelService`` at a pushed address (``set_address``)."""

    def __init__(self, address: str | None, security=None) -> None:
        self.security, self.address, self._stub, self._channel = security, None, None, None
        self.retries = 0
        """Attempts that failed with a retried status (service restarting)."""
        if address:
            self.set_address(address)

    def set_address(self, address: str) -> None:
        """Dial ``address`` for the next attempts (no-op for the same one)."""
        if address == self.address:
            return
        old = self._channel
        self._channel = grpc_common.channel(address, self.security)
        self._stub, self.address = reward_model_pb2_grpc.RewardModelServiceStub(self._channel), address
        if old is not None:
            old.close()

    def _call(self, request, timeout_s: float):
        if self._stub is None:
            raise _NoAddress()
        return self._stub.Score(request, timeout=timeout_s)

    async def score(self, spec: ModelSpec, items: list[ScoreItem], deadline_s: float) -> list[RewardResult]:
        """See ``rollout.rewards.model.Transport.score``."""
        request = reward_model_pb2.ScoreRequest(spec_json=spec.key, items=[
            reward_model_pb2.ScoreItem(prompt_json=json.dumps(it.prompt), completion=it.completion,
                                       reference=it.reference) for it in items])
        end = time.monotonic() + deadline_s

        def failed(error: str) -> list[RewardResult]:
            return [RewardResult(0.0, spec.version, error[:500])] * len(items)

        try:
            async for attempt in AsyncRetrying(retry=retry_if_exception(_retried), reraise=True,
                                               stop=stop_after_delay(deadline_s),
                                               wait=wait_exponential(multiplier=0.2, max=2.0)):
                with attempt:
                    left = max(0.1, min(ATTEMPT_S, end - time.monotonic()))
                    try:
                        reply = await asyncio.to_thread(self._call, request, left)
                    except Exception as exc:
                        if _retried(exc):
                            self.retries += 1
                        raise
        except _NoAddress:
            return failed(f"timeout: no reward-model service address within {deadline_s:.1f} s")
        except grpc.RpcError as exc:
            if exc.code() in RETRIED:
                return failed(f"timeout: reward-model service not reachable within {deadline_s:.1f} s "
                              f"({exc.code().name}: {exc.details()})")
            return failed(f"reward model refused: {exc.code().name}: {exc.details()}")
        if len(reply.scores) != len(items) or len(reply.errors) != len(items):
            return failed(f"reward model answered {len(reply.scores)} scores for {len(items)} responses")
        return [RewardResult(0.0 if e else s, reply.version, e) for s, e in zip(reply.scores, reply.errors)]
