"""Settings one section of a recipe takes from another, before the recipe is validated (``Recipe``'s
``mode="before"`` validators call these in order): the top-level model, lockstep's shared config, replay's
``groups_per_step`` and the learner's generation budget. Each takes and returns the raw recipe dict, copying only
what it changes; anything that is not a dict is left for validation to report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyre.learner.loop import LearnerLoopConfig
from gyre.rollout.config import SamplingConfig

MODEL_KEYS = ("model", "model_id", "model_revision")
"""Top-level recipe keys copied into ``rollout.engine`` and ``learner.engine``."""


def share_model(data: Any) -> Any:
    """The top-level ``model`` / ``model_id`` / ``model_revision`` go into ``rollout.engine`` and ``learner.engine``;
    a section that sets one itself is refused (``ValueError`` naming it)."""
    if isinstance(data, dict) and "model" in data:
        data = dict(data)  # copies all the way down to what changes: the caller's dicts stay as they were
        for section, key in (("rollout", "engine"), ("learner", "engine")):
            part = data.get(section, {})
            if isinstance(part, dict):
                sub = part.get(key, {})
                if isinstance(sub, dict):
                    shared = {k: data[k] for k in MODEL_KEYS if data.get(k) is not None}
                    if set(MODEL_KEYS) & set(sub):
                        raise ValueError(f"set the model once at top level, not in {section}.{key}."
                                         f"{sorted(set(MODEL_KEYS) & set(sub))[0]}")
                    data[section] = {**part, key: {**sub, **shared}}
    return data


def share_lockstep(data: Any) -> Any:
    """``determinism: lockstep`` hands one ``LockstepConfig`` to the rollouts and the learner."""
    if not isinstance(data, dict):
        return data
    for section in ("rollout", "learner"):
        if isinstance(data.get(section), dict) and "lockstep" in data[section]:
            raise ValueError(f"{section}.lockstep is set from the top-level determinism/lockstep_lag keys; "
                             "remove it")
    if data.get("determinism") == "lockstep":
        learner = data.get("learner") if isinstance(data.get("learner"), dict) else {}
        out = Path(str(data.get("run_dir", "runs"))).resolve() / str(data.get("name", ""))
        shared = {"lag": data.get("lockstep_lag", 1), "groups_per_step": learner.get("groups_per_step", 8),
                  "seed": data.get("seed", 0), "weights_dir": str(out / "weights")}
        data = {**data, **{section: {**data[section], "lockstep": dict(shared)}
                           for section in ("rollout", "learner") if isinstance(data.get(section), dict)}}
    return data


def share_groups_per_step(data: Any) -> Any:
    """``replay.groups_per_step`` (the unit of the fleet's work budget, ``ReplayConfig.work_budget``) defaults
    to ``learner.groups_per_step``."""
    if not isinstance(data, dict):
        return data
    replay = data.get("replay", {})
    learner = data.get("learner", {})
    if not isinstance(replay, dict) or "groups_per_step" in replay or not isinstance(learner, dict):
        return data
    per_step = learner.get("groups_per_step", LearnerLoopConfig.model_fields["groups_per_step"].default)
    if type(per_step) is not int:  # a bad value is reported at learner.groups_per_step alone
        return data
    return {**data, "replay": {**replay, "groups_per_step": per_step}}


def share_generation_budget(data: Any) -> Any:
    """``learner.algorithm.max_response_tokens`` defaults to ``rollout.sampling.max_new_tokens``: the
    generation budget ``L_max`` of Dr.GRPO's constant normaliser and of DAPO's soft overlong punishment."""
    if not isinstance(data, dict) or not isinstance(data.get("rollout"), dict):
        return data
    learner, sampling = data.get("learner"), data["rollout"].get("sampling", {})
    algo = learner.get("algorithm", {}) if isinstance(learner, dict) else None
    if not isinstance(algo, dict) or "max_response_tokens" in algo or not isinstance(sampling, dict):
        return data
    budget = sampling.get("max_new_tokens", SamplingConfig.model_fields["max_new_tokens"].default)
    if type(budget) is not int:  # a bad value is reported at rollout.sampling.max_new_tokens alone
        return data
    return {**data, "learner": {**learner, "algorithm": {**algo, "max_response_tokens": budget}}}
