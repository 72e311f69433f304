"""One supervisor health round over a run's services, all at once: every ``describe()`` (and each learner rank's) is
in flight together under one deadline, and the gRPC health checks of the servers (replay, learner, reward model) run
side by side, so a round takes one deadline however large the fleet (asked one after another, 256 rollouts took up to
256 deadlines).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import ray
import structlog
from ray.exceptions import GetTimeoutError, RayActorError

from gyre.services.common.grpc_common import check_health

log = structlog.get_logger("supervisor")


def health_round(svcs: list, check_timeout_s: float, fail_threshold: int, security=None) -> list[bool]:
    """Check every service of ``svcs`` (``Service``s) at once within ``check_timeout_s`` seconds. Returns, per
    service, ``False`` once it must be restarted: dead (its actor is gone), or unhealthy (no answer in time, or its
    gRPC health not SERVING) for ``fail_threshold`` rounds in a row. Updates ``svc.info`` and ``svc.failures``."""
    asked = [(svc.handle.describe.remote(), [f.describe.remote() for f in svc.followers]) for svc in svcs]
    refs = [r for own, ranks in asked for r in (own, *ranks)]
    ready = set(ray.wait(refs, num_returns=len(refs), timeout=check_timeout_s)[0]) if refs else set()
    servers = [svc for svc in svcs if svc.address is not None]
    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        grpc_ok = dict(zip((s.name for s in servers), pool.map(
            lambda svc: check_health(svc.address, timeout_s=check_timeout_s, security=security), servers)))
    return [_judge(svc, own, ranks, ready, grpc_ok.get(svc.name, True), fail_threshold)
            for svc, (own, ranks) in zip(svcs, asked)]


def _judge(svc, own, ranks: list, ready: set, grpc_ok: bool, fail_threshold: int) -> bool:
    """One service's verdict from its answers (``health_round``)."""
    try:
        if own not in ready or any(r not in ready for r in ranks):
            raise GetTimeoutError()
        svc.info = ray.get(own)
        ray.get(ranks)  # learner ranks >= 1
        healthy = grpc_ok
    except RayActorError:
        svc.failures = fail_threshold  # the process is gone: no point waiting
        return False
    except GetTimeoutError:
        healthy = False
    svc.failures = 0 if healthy else svc.failures + 1
    if not healthy:
        log.warning("health_check_failed", service=svc.name, failures=svc.failures)
    return svc.failures < fail_threshold
