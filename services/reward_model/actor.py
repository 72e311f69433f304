"""The reward-model service as a Ray actor: ``RewardModelService`` over a ``RewardModelHost``, ``describe()``.
Actor conventions: ``services.common.actor_env``. Nothing to restore on a restart: scores are a pure function of
the request and the model files, and every client retries its request until its own deadline."""

from __future__ import annotations

import os

import ray

from gyre.services.common.actor_env import advertised_host, node_ip, security_config
from gyre.services.common.service_info import RewardModelInfo


@ray.remote
class RewardModelActor:
    """The reward-model service.

    Args:
        config: ``RewardServiceConfig`` fields.
        rewards: ``RewardConfig`` dicts of the recipe's model rewards, loaded before the server answers (a model
            that does not load fails the actor's creation with its ``RewardModelError``); models a swap names
            later load on their first request.
        host: address to bind (``None``: ``security.bind_host``, else 127.0.0.1).
        security: ``SecurityConfig`` fields (``None``: plaintext loopback).
        run_id: carried by every log line.
    """

    def __init__(self, config: dict, rewards: list[dict], host: str | None = None, security: dict | None = None,
                 run_id: str = "run") -> None:
        from gyre.rollout.rewards.base import RewardConfig
        from gyre.rollout.rewards.model import model_spec
        from gyre.services.reward_model.host import RewardModelHost
        from gyre.services.common.cpus import pin_from_env
        from gyre.services.common.logs import configure_logging
        from gyre.services.reward_model.config import RewardServiceConfig
        from gyre.services.reward_model.server import serve

        configure_logging(run_id, "reward_model")
        pin_from_env("reward_model")  # placement.<role>.cpus, before any compute thread starts
        sec = security_config(security)
        host = host or (sec.bind_host if sec is not None else "127.0.0.1")
        cfg = RewardServiceConfig(**config)
        self.models = RewardModelHost(cfg.batch_size, cfg.max_models)
        for raw in rewards:
            self.models.load(model_spec(RewardConfig.model_validate(raw)))
        self.server, self.port, self.batcher = serve(self.models, cfg, host=host, security=sec)
        self.host = advertised_host(host)

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def describe(self) -> RewardModelInfo:
        return RewardModelInfo(pid=os.getpid(), node=node_ip(), address=self.address(),
                               models=self.models.versions(), counts=dict(self.batcher.counts))

    def stop(self) -> None:
        self.server.stop(grace=2).wait()
