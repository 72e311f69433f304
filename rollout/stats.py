"""What a rollout worker counts (``RolloutStats``, served as its stats, Prometheus gauges and metrics rows), and
per-reward means merged over a fleet."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rollout.spool import Spool


@dataclass
class RolloutStats:
    groups: int = 0
    trajectories: int = 0
    tokens: int = 0
    reward_sum: float = 0.0
    started_at: float = field(default_factory=time.monotonic)
    weight_updates: int = 0
    last_update_s: float = 0.0
    insert_retries: int = 0
    groups_in_flight: int = 0
    """Groups being generated now (generation tasks of ``RolloutWorker.run``)."""
    timeline_switches: int = 0
    """Weight loads from another timeline than the engine's (``proto.timeline``: the learner rewound)."""
    groups_dropped_on_switch: int = 0
    """Groups in generation cancelled by a timeline switch (their prompt leases expire and are re-issued)."""
    gate_waits: int = 0
    """Passes of the generation loop that found the version gate (``max_groups_per_version``) closed; each
    then waits (up to 0.5 s for a group in flight to finish, else up to 0.2 s for a newer version)."""
    prompts_too_long: int = 0
    """Dataset rows skipped when the task source was built: their prompt does not fit the engine's context
    (``rollout.dataset_source.PromptBudget``); they get no prompt index."""
    spool: Spool | None = None
    """The worker's spool, if configured; its gauges (``SpoolStats.as_dict``) join ``as_dict``."""
    reward_errors: int = 0
    """Trajectories whose reward reached no verdict (``reward_error`` set; their stored reward is 0.0)."""
    reward_parts: dict[str, list[float]] = field(default_factory=dict)
    """``"{task}/{reward label}"`` → ``[sum of scores, number of scores]`` over the verdicts of that reward
    alone (before weighting; failed scores are not counted)."""

    def count_rewards(self, task: str, parts: dict) -> None:
        """Add one group's per-reward results (``GroupScore.parts``) to ``reward_parts``."""
        for name, results in parts.items():
            acc = self.reward_parts.setdefault(f"{task}/{name}", [0.0, 0])
            for r in results:
                if not r.error:
                    acc[0] += r.reward
                    acc[1] += 1

    def as_dict(self, version: int) -> dict:
        elapsed = max(time.monotonic() - self.started_at, 1e-9)
        return {"version": version, "groups": self.groups, "trajectories": self.trajectories,
                "tokens": self.tokens, "tokens_per_s": self.tokens / elapsed,
                "reward_mean": self.reward_sum / max(self.trajectories, 1),
                "weight_updates": self.weight_updates, "last_update_s": self.last_update_s,
                "insert_retries": self.insert_retries, "groups_in_flight": self.groups_in_flight,
                "gate_waits": self.gate_waits, "prompts_too_long": self.prompts_too_long,
                "reward_errors": self.reward_errors,
                "timeline_switches": self.timeline_switches, "groups_dropped_on_switch": self.groups_dropped_on_switch,
                "reward_means": {k: s / n for k, (s, n) in self.reward_parts.items() if n},
                "reward_counts": {k: n for k, (_, n) in self.reward_parts.items()},
                **(self.spool.stats().as_dict() if self.spool else {})}


def merge_reward_means(stats: list[dict]) -> dict[str, float]:
    """Per-reward means over several rollouts' ``RolloutStats.as_dict`` (weighted by their counts)."""
    sums: dict[str, list[float]] = {}
    for st in stats:
        for key, n in st.get("reward_counts", {}).items():
            if n:
                acc = sums.setdefault(key, [0.0, 0])
                acc[0] += st["reward_means"][key] * n
                acc[1] += n
    return {k: s / n for k, (s, n) in sorted(sums.items())}
