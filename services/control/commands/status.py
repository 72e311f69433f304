"""What ``gyre status`` shows of a supervised run: one plain dict built from the services' ``describe()`` records
(``services.common.service_info``) the supervisor keeps, so it crosses the controller actor and ``--json`` as is."""

from __future__ import annotations

import time

from gyre.services.common.service_info import LearnerInfo, RewardModelInfo, RolloutInfo
from gyre.services.control.orchestration.factory import Service


def run_status(sup) -> dict:
    """Plain status of the run ``sup`` (a ``Supervisor``) supervises — what ``gyre status`` prints: plain values read
    from the services' ``describe()`` records, so it crosses the controller actor and ``--json`` as is."""
    rollouts = [s.info for s in sup.running_rollouts() if s.info is not None]
    version = sup.learner.version
    shards = [s.info for s in sup.replay_shards()]
    return {
        "services": [_service_row(s) for s in sup.services.values() if s.name not in sup.starting]
        + [{"name": n, "role": "rollout", "pid": None, "node": None, "address": None, "metrics_port": None,
            "version": None, "restarts": st.restarts, "failures": 0, "starting": True}
           for n, st in sup.starting.items()],
        "learner_version": version,
        "learner_ranks": 1 + len(sup.learner.followers),
        "rollout_versions": [r.version for r in rollouts],
        "lag": (version - min(r.version for r in rollouts)) if rollouts and version is not None else None,
        "rollout_tokens_per_s": sum(r.tokens_per_s for r in rollouts),
        **_learner_columns(sup.learner.info),
        "replay_groups": sum(i.replay_groups for i in shards) if shards and None not in shards else None,
        "replay_shards": len(shards),
        "supervisor": sup.tick_times.summary(),
        "rollout_join_s": dict(sup.joined_s),
        "restarts": sup.restart_counts(),
        "logs": str(sup.factory.log_dir),
        "reward_swaps": sup.factory.swaps.count,
        "reward_models": _reward_models(sup.services.get("reward_model")),
        "updated_at": time.time(),
    }


def _service_row(s: Service) -> dict:
    """One row of the status's service table."""
    info = s.info
    return {"name": s.name, "role": s.role, "pid": info.pid if info is not None else None,
            "node": info.node if info is not None else None, "address": s.address,
            "metrics_port": info.metrics_port if info is not None else None, "version": s.version,
            "restarts": s.restarts, "failures": s.failures,
            "reward_versions": info.reward_versions if isinstance(info, RolloutInfo) else None}


def _learner_columns(info: LearnerInfo | None) -> dict:
    """The status's learner columns (each ``None`` before the learner's first ``describe()``)."""
    if info is None:
        return dict.fromkeys(("learner_tokens_per_s", "checkpoint_age_s", "last_checkpoint", "learner_resumed_from"))
    return {"learner_tokens_per_s": info.tokens_per_s, "checkpoint_age_s": info.checkpoint_age_s,
            "last_checkpoint": info.last_checkpoint, "learner_resumed_from": info.resumed_from}


def _reward_models(svc: Service | None) -> dict | None:
    """The reward-model service's ``{model: reward version}`` loaded now and its counts (``None``: no such service,
    or before its first ``describe()``)."""
    if svc is None or not isinstance(svc.info, RewardModelInfo):
        return None
    return {"models": dict(svc.info.models), "counts": dict(svc.info.counts)}
