"""The replay service as a Ray actor: the Arrow buffer behind ReplayService, its metrics, ``describe()``.
Actor conventions: ``services.common.actor_env``."""

from __future__ import annotations

import os

import ray

from gyre.services.common.actor_env import advertised_host, node_ip, security_config
from gyre.services.common.names import ServiceName
from gyre.services.common.service_info import ReplayInfo


@ray.remote
class ReplayActor:
    """The replay service: the Arrow buffer (durable when given a directory) behind ReplayService.

    Args:
        config: ``ReplayConfig`` fields (``shard``: which shard of a sharded replay this is; its logs and metrics
            are labelled ``replay-shard-{k}`` for ``k >= 1``).
        host: address to bind (``None``: ``security.bind_host``, else 127.0.0.1).
        dir: WAL/snapshot directory, overriding ``config["dir"]`` (the controller passes ``{run_dir}/replay``);
            an existing directory is restored first (a restarted replay rejoins with its own snapshot + WAL).
        metrics_port: serve Prometheus ``/metrics`` on this port (0 = any free port; ``None`` = off).
        security: ``SecurityConfig`` fields (``None``: plaintext loopback).
        run_id: carried by every log line (structlog JSON) and metric of this service.
    """

    def __init__(self, config: dict, host: str | None = None, dir: str | None = None,
                 metrics_port: int | None = 0, security: dict | None = None, run_id: str = "run") -> None:
        from gyre.replay.buffer import TrajectoryBuffer
        from gyre.replay.config import ReplayConfig
        from gyre.services.common.cpus import pin_from_env
        from gyre.services.common.logs import configure_logging
        from gyre.services.common.observability import serve
        from gyre.services.replay import server as replay_server
        from gyre.services.replay.metrics import replay_registry

        cfg = ReplayConfig(**{**config, **({"dir": dir} if dir is not None else {})})
        service = str(ServiceName("replay", cfg.shard))  # replay, or replay-shard-{k}: its log file and metric label
        configure_logging(run_id, service)
        pin_from_env("replay")  # placement.<role>.cpus, before any compute thread starts
        sec = security_config(security)
        host = host or (sec.bind_host if sec is not None else "127.0.0.1")
        self.security = sec
        self.buffer = TrajectoryBuffer(cfg)
        self.server, self.port = replay_server.serve(self.buffer, host=host, security=sec)
        self.host = advertised_host(host)
        self.metrics_port = (serve(replay_registry(self.buffer, run_id, service), host, metrics_port)
                             if metrics_port is not None else None)

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def info(self) -> dict:
        return self.buffer.info()

    def stored_trajectory_ids(self) -> list[str]:
        """Ids of every trajectory replay holds now (pooled, leased or excluded; acked groups are gone)."""
        data = self.buffer.capture()
        return [t for g in data.groups for t in g.table.column("trajectory_id").to_pylist()]

    def describe(self) -> ReplayInfo:
        info = self.buffer.info()
        return ReplayInfo(pid=os.getpid(), node=node_ip(), address=self.address(), metrics_port=self.metrics_port,
                          replay_groups=info["size_groups"], replay_trajectories=info["size_trajectories"],
                          learner_version=info["learner_version"], inserts_per_s=info["inserts_per_s"])

    def stop(self) -> None:
        self.server.stop(grace=2).wait()
        self.buffer.close()

