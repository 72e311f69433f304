"""The reward-model gRPC server: ``RewardModelService.Score`` over a ``RewardModelHost``, with request batching.

Every rollout sends its groups' responses as one ``Score`` request; gRPC handler threads put them on one queue
and a single batcher thread takes the first waiting request, then every request that arrives within
``max_wait_ms`` (or until ``batch_size`` responses are waiting), groups them by model and scores each model's
share in one call of the host (one forward pass per ``batch_size`` responses). So N rollouts cost one forward
pass where they would cost N, as vLLM's continuous batching does for generation (and as verl's reward-model
worker batches a whole step).

Crash test: the fault point ``reward_model.batch_scored`` fires after a batch was scored, before its replies
are sent — the clients' requests then fail with UNAVAILABLE and are retried against the restarted service.
"""

from __future__ import annotations

import functools
import json
import queue
import threading
import time
from concurrent.futures import Future

import grpc
import structlog

from gyre.faults import fault_point
from gyre.proto import reward_model_pb2, reward_model_pb2_grpc
from gyre.rollout.rewards.model import ModelSpec, RewardModelError, ScoreItem
from gyre.services.reward_model.host import RewardModelHost
from gyre.services.common import grpc_common
from gyre.services.common.security import SecurityConfig
from gyre.services.reward_model.config import RewardServiceConfig

log = structlog.get_logger("reward_model")
SERVICE_NAME = "gyre.reward_model.v1.RewardModelService"


class _Pending:
    def __init__(self, spec: ModelSpec, items: list[ScoreItem]) -> None:
        self.spec, self.items, self.done = spec, items, Future()


class Batcher:
    """One thread scoring the queued requests in batches (module docstring). ``counts`` tallies requests,
    batches and responses scored."""

    def __init__(self, host: RewardModelHost, batch_size: int, max_wait_s: float) -> None:
        self.host, self.batch_size, self.max_wait_s = host, batch_size, max_wait_s
        self.queue: queue.Queue[_Pending] = queue.Queue()
        self.counts = {"requests": 0, "batches": 0, "responses": 0, "failed_loads": 0}
        self._thread = threading.Thread(target=self._run, name="gyre-rm-batcher", daemon=True)
        self._thread.start()

    def submit(self, spec: ModelSpec, items: list[ScoreItem]) -> Future:
        """Queue one request; its future gives ``[(reward, error)]`` or raises ``RewardModelError``."""
        pending = _Pending(spec, items)
        self.queue.put(pending)
        return pending.done

    def _take(self) -> list[_Pending]:
        batch = [self.queue.get()]
        deadline = time.monotonic() + self.max_wait_s
        while sum(len(p.items) for p in batch) < self.batch_size:
            try:
                batch.append(self.queue.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            by_model: dict[str, list[_Pending]] = {}
            for p in batch:
                by_model.setdefault(p.spec.key, []).append(p)
            for requests in by_model.values():
                self._score(requests)

    def _score(self, requests: list[_Pending]) -> None:
        items = [it for p in requests for it in p.items]
        try:
            results = self.host.score(requests[0].spec, items)
        except Exception as exc:  # a model that does not load fails these requests, not the service
            self.counts["failed_loads"] += 1
            error = exc if isinstance(exc, RewardModelError) else RewardModelError(f"{type(exc).__name__}: {exc}")
            log.error("reward_model_failed", model=requests[0].spec.model, error=str(exc)[:300])
            for p in requests:
                p.done.set_exception(error)
            return
        self.counts["requests"] += len(requests)
        self.counts["batches"] += 1
        self.counts["responses"] += len(items)
        fault_point("reward_model.batch_scored")
        i = 0
        for p in requests:
            p.done.set_result(results[i:i + len(p.items)])
            i += len(p.items)


def parse_request(request, max_items: int) -> tuple[ModelSpec, list[ScoreItem]]:
    """``(spec, items)`` of a ``ScoreRequest``.

    Raises:
        ValueError: ``spec_json`` that is not a spec, a prompt that is not a JSON list of messages, or more
            than ``max_items`` items; the message names the value.
    """
    if len(request.items) > max_items:
        raise ValueError(f"{len(request.items)} items in one request; at most {max_items}")
    try:
        raw = json.loads(request.spec_json)
        spec = ModelSpec(raw["model"], raw["kind"], dict(raw["params"]), "", raw["version"], raw.get("revision"))
        if spec.kind not in ("classifier", "judge"):
            raise ValueError(f"kind {spec.kind!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"spec_json {request.spec_json[:200]!r} is not a reward-model spec "
                         f"({{model, kind, params, version}}): {exc}") from None
    items = []
    for i, it in enumerate(request.items):
        try:
            prompt = json.loads(it.prompt_json)
            if not isinstance(prompt, list) or not all(isinstance(m, dict) and "content" in m for m in prompt):
                raise ValueError("not a list of {role, content} messages")
        except ValueError as exc:
            raise ValueError(f"items[{i}].prompt_json {it.prompt_json[:120]!r}: {exc}") from None
        items.append(ScoreItem(prompt, it.completion, it.reference))
    return spec, items


class RewardModelServicer(reward_model_pb2_grpc.RewardModelServiceServicer):
    """``Score``: parse, resolve the model's folder here, queue on the batcher, wait for the batch."""

    def __init__(self, batcher: Batcher, config: RewardServiceConfig) -> None:
        self.batcher, self.config = batcher, config

    def Score(self, request, context):  # noqa: N802 (gRPC's method name)
        try:
            spec, items = parse_request(request, self.config.max_items)
            spec = _localise(spec)
        except RewardModelError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            results = self.batcher.submit(spec, items).result()
        except RewardModelError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return reward_model_pb2.ScoreReply(scores=[r for r, _ in results], errors=[e for _, e in results],
                                           version=spec.version)


def _localise(spec: ModelSpec) -> ModelSpec:
    """The spec with ``path`` resolved on this node (the rollout resolved it on its own; cached per spec)."""
    return ModelSpec(spec.model, spec.kind, spec.params, _local_path(spec.key), spec.version, spec.revision)


@functools.lru_cache(maxsize=32)
def _local_path(key: str) -> str:
    from gyre.rollout.rewards.base import RewardConfig
    from gyre.rollout.rewards.model import model_spec

    raw = json.loads(key)
    params = _non_default(raw["kind"], raw["params"])
    if raw.get("revision"):
        params["revision"] = raw["revision"]
    return model_spec(RewardConfig(model=raw["model"], kind=raw["kind"], params=params)).path


def _non_default(kind: str, params: dict) -> dict:
    from gyre.rollout.rewards.model import PARAMS

    defaults = PARAMS[kind]().model_dump()
    return {k: v for k, v in params.items() if defaults.get(k) != v}


def serve(host_models: RewardModelHost, config: RewardServiceConfig, host: str | None = None, port: int = 0,
          security: SecurityConfig | None = None) -> tuple[grpc.Server, int, Batcher]:
    """Start the server (SERVING once started); returns ``(server, bound port, batcher)``."""
    batcher = Batcher(host_models, config.batch_size, config.max_wait_ms / 1000)
    server, health_servicer = grpc_common.make_server(security=security)
    reward_model_pb2_grpc.add_RewardModelServiceServicer_to_server(RewardModelServicer(batcher, config), server)
    port = grpc_common.start(server, health_servicer, SERVICE_NAME, host, port, security)
    log.info("reward_model_serving", port=port)
    return server, port, batcher
