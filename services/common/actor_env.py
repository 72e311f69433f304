"""What every service's Ray actor shares: the node it runs on, the host it advertises, its security settings.

Ray actors wrap one service each (its gRPC server and its core) so the controller can place, watch, restart
and stop it. Configs cross as plain dicts (Ray control messages); data goes over gRPC. Every actor answers
``describe()`` with a frozen record of its kind (``services.common.service_info``: pid, node, role-specific gauges)
for the supervisor and ``gyre status``. Addresses change when a service is restarted (a new process binds a new
port, maybe on another node); the supervisor pushes the new one to the services that dial it, by the methods
``services.control.orchestration.topology`` names (``set_replay_address`` to the learner and every rollout,
``set_weights_address`` to every rollout). Clients look the address up on every call, so a call that failed
against the dead server is retried against the new one (``services.common.replay_links``).

The actors: ``services.replay.actor.ReplayActor``, ``services.learner.actor.LearnerActor`` and
``LearnerRankActor``, ``services.rollout.actor.RolloutActor``.
"""

from __future__ import annotations

import ray


def node_ip() -> str:
    """This process's node IP as Ray sees it, or ``"127.0.0.1"`` outside Ray."""
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def advertised_host(bind_host: str) -> str:
    """The host other services dial: the node's IP when binding every interface, else ``bind_host``."""
    return node_ip() if bind_host in ("0.0.0.0", "::", "") else bind_host


def security_config(config: dict | None):
    """``SecurityConfig`` from its fields as they crossed Ray (a plain dict, with the run's generated token when it has
    one: ``services.common.run_token``), or ``None`` (plaintext loopback)."""
    from gyre.services.common.run_token import materialize
    from gyre.services.common.security import SecurityConfig

    return SecurityConfig(**materialize(config)) if config is not None else None
