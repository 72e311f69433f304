"""Several rewards of one task combined as a weighted sum (``task.rewards``; TRL's ``reward_weights``).

A ``RewardSet`` holds one or more rewards (built-in ``RewardFn``s and ``FunctionReward``s), each with a
weight and a label. A completion's reward is ``Σ_k weight_k · score_k`` over the rewards that scored it: a
reward function that returned ``None`` for it abstains (TRL turns ``None`` into NaN and sums with ``nansum``), so
the others still score the row. When a reward failed (raised, timed out, returned a non-number), or every reward
abstained, the completion's reward is 0.0 and its ``reward_error`` names the reward(s), so the whole row counts as
failed (TRL would stop on the exception, and give 0 to a row nothing scored). One reward of weight 1 behaves exactly as that reward alone (same version,
same error text).
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.rollout.rewards.base import RewardConfig, RewardResult
from gyre.rollout.rewards.registry import make_reward


@dataclass(frozen=True)
class RewardPart:
    """One reward of a set."""

    label: str
    """Unique in its set: the reward's ``RewardConfig.label`` (``#2``, ``#3`` … appended to repeats)."""
    weight: float
    reward: object
    """A ``RewardFn`` or ``FunctionReward`` (``make_reward``)."""


@dataclass(frozen=True)
class GroupScore:
    """The scores of one group."""

    results: list[RewardResult]
    """``[n]`` combined reward, set version and error per completion (what the trajectory records)."""
    parts: dict[str, list[RewardResult]]
    """label → ``[n]`` that reward's own results (for per-reward metrics)."""


class RewardSet:
    """A task's rewards. ``version`` is the one reward's version when it is alone with weight 1, else
    ``"w1*v1+w2*v2..."`` (weights with ``:g``); ``name`` likewise (labels).

    Raises:
        ValueError: ``parts`` is empty.
    """

    def __init__(self, parts: list[RewardPart]) -> None:
        if not parts:
            raise ValueError("a reward set needs at least one reward")
        self.parts = list(parts)
        if len(parts) == 1 and parts[0].weight == 1.0:
            self.version, self.name = parts[0].reward.version, parts[0].reward.name
        else:
            self.version = "+".join(f"{p.weight:g}*{p.reward.version}" for p in parts)
            self.name = "+".join(p.label for p in parts)

    def combine(self, per_part: list[list[RewardResult]]) -> GroupScore:
        """``per_part[k][j]``: reward k's result for completion j → the group's combined score."""
        n = len(per_part[0])
        results = []
        for j in range(n):
            failed = [(p.label, rs[j].error) for p, rs in zip(self.parts, per_part)
                      if rs[j].error and not rs[j].abstained]
            if not failed and all(rs[j].abstained for rs in per_part):  # nothing scored the row
                failed = [(p.label, rs[j].error) for p, rs in zip(self.parts, per_part)]
            if failed and len(self.parts) == 1:
                results.append(RewardResult(0.0, self.version, failed[0][1]))
            elif failed:
                error = "; ".join(f"{label}: {err}" for label, err in failed)[:500]
                results.append(RewardResult(0.0, self.version, error))
            else:
                total = sum(p.weight * rs[j].reward for p, rs in zip(self.parts, per_part) if not rs[j].abstained)
                results.append(RewardResult(total, self.version))
        return GroupScore(results, {p.label: rs for p, rs in zip(self.parts, per_part)})


def make_reward_set(configs: list[RewardConfig | str | dict], dataset=None) -> RewardSet:
    """Build each reward (``make_reward``; raises what it raises) into a ``RewardSet``."""
    parts, seen = [], {}
    for raw in configs:
        cfg = raw if isinstance(raw, RewardConfig) else RewardConfig.model_validate(raw)
        seen[cfg.label] = seen.get(cfg.label, 0) + 1
        label = cfg.label if seen[cfg.label] == 1 else f"{cfg.label}#{seen[cfg.label]}"
        parts.append(RewardPart(label, cfg.weight, make_reward(cfg, dataset)))
    return RewardSet(parts)
