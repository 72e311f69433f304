"""Service names of a run: ``replay``, ``replay-shard-{k}`` (shards >= 1 of a sharded replay, ``replay.shards``),
``learner``, ``learner-rank-{r}`` (ranks >= 1 of a multi-rank learner), ``rollout-{i}`` and ``reward_model`` (when a task's reward names a model). Parsed once (``ServiceName.parse``) and formatted once (``str``): nothing else slices names."""

from __future__ import annotations

import re
from dataclasses import dataclass

ROLES = ("replay", "learner", "rollout", "reward_model")
SINGLE = ("reward_model",)
"""Roles with one service and no index."""

_NAME = re.compile(r"^(?:(reward_model)|(learner)(?:-rank-([1-9][0-9]*))?|(rollout)-(0|[1-9][0-9]*)"
                   r"|(replay)(?:-shard-([1-9][0-9]*))?)$")


@dataclass(frozen=True, order=True)
class ServiceName:
    """One service of a run: its ``role`` and ``index``.

    ``index`` is the rollout's number for ``rollout``, the DeepSpeed rank for ``learner`` (0: the ``learner``
    service itself, ``LearnerActor``; ``r >= 1``: ``learner-rank-{r}``, a ``LearnerRankActor``), the shard for
    ``replay`` (0: ``replay``; ``k >= 1``: ``replay-shard-{k}``, each its own ``ReplayActor``), and 0 for
    ``reward_model``. Ordered by (role, index), so rollouts sort by number (``rollout-2`` before ``rollout-10``).

    Raises:
        ValueError: an unknown role, a negative index, or an index for ``reward_model``.
    """

    role: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown service role {self.role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(self.index, int) or self.index < 0 or (self.role in SINGLE and self.index):
            raise ValueError(f"bad index {self.index!r} for a {self.role} service")

    @classmethod
    def rollout(cls, index: int) -> ServiceName:
        return cls("rollout", index)

    @classmethod
    def parse(cls, name: str) -> ServiceName:
        """The service named ``name`` (exactly as ``str`` formats it: no leading zeros).

        Raises:
            ValueError: not a service name.
        """
        m = _NAME.match(name) if isinstance(name, str) else None
        if m is None:
            raise ValueError(f"not a service name: {name!r} (replay, replay-shard-<k>, learner, learner-rank-<r>, "
                             "rollout-<i> or reward_model)")
        single, learner, rank, _, index, replay, shard = m.groups()
        if single:
            return cls(single)
        if replay:
            return cls("replay", int(shard or 0))
        return cls("learner", int(rank or 0)) if learner else cls("rollout", int(index))

    def __str__(self) -> str:
        if self.role == "rollout":
            return f"rollout-{self.index}"
        if self.index and self.role == "replay":
            return f"replay-shard-{self.index}"
        return f"learner-rank-{self.index}" if self.role == "learner" and self.index else self.role
