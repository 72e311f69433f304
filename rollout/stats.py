"""What a rollout worker counts (``RolloutStats``, served as its stats, Prometheus gauges and metrics rows), where
its time goes (``BusyClock``), and per-reward means merged over a fleet."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gyre.rollout.agents.env_threads import EnvThreads
from gyre.rollout.spool import Spool


ROLLOUT_PHASES = ("generate", "score", "insert", "weight_apply")
"""The phases of a rollout's work whose cumulative seconds ``RolloutStats.as_dict`` answers as ``{phase}_s``."""


@dataclass
class BusyClock:
    """Wall seconds during which at least one task was inside ``with clock:`` — concurrent tasks (the groups in
    flight of an asyncio worker) count once, so it never runs faster than the wall clock. One event loop (or
    thread) enters and leaves it; measured with ``time.perf_counter``."""

    total_s: float = 0.0
    """Seconds of the busy spans that ended."""
    active: int = 0
    """Tasks inside now."""
    since: float = 0.0
    """``perf_counter`` when the current busy span began (``active`` went 0 → 1)."""

    def __enter__(self) -> BusyClock:
        if self.active == 0:
            self.since = time.perf_counter()
        self.active += 1
        return self

    def __exit__(self, *exc) -> None:
        self.active -= 1
        if self.active == 0:
            self.total_s += time.perf_counter() - self.since

    def seconds(self) -> float:
        """Busy seconds so far, the current span included."""
        return self.total_s + (time.perf_counter() - self.since if self.active else 0.0)


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
    env_threads: EnvThreads | None = None
    """Where a multi-turn environment's blocking methods run (``rollout.env_threads``), if the rollout has one; its
    counters (``env_calls_stuck``, ``env_calls_abandoned``, ``env_calls_refused``) join ``as_dict``."""
    reward_errors: int = 0
    """Trajectories whose reward reached no verdict (``reward_error`` set; their stored reward is 0.0)."""
    reward_parts: dict[str, list[float]] = field(default_factory=dict)
    """``"{task}/{reward label}"`` → ``[sum of scores, number of scores]`` over the verdicts of that reward
    alone (before weighting; failed scores are not counted)."""
    generate: BusyClock = field(default_factory=BusyClock)
    """Wall seconds during which at least one group was in ``engine.generate`` (includes time the engine was
    paused for a weight update while a group waited in it)."""
    score: BusyClock = field(default_factory=BusyClock)
    """Wall seconds during which at least one group was being scored (reward functions / reward service)."""
    insert: BusyClock = field(default_factory=BusyClock)
    """Wall seconds during which at least one insert to replay was in flight or waiting to be retried (the
    worker's own or, with a spool, the flusher's; writing a group to the spool is not counted)."""
    weight_apply_s: float = 0.0
    episodes: dict[str, int] = field(default_factory=dict)
    """Multi-turn counters (``count_episodes``): ``episodes``, ``turns``, ``tool_calls``, ``tool_errors``,
    ``broken`` and ``end/<episode_end>``; empty for single-turn rollouts."""
    """Seconds the engine was paused applying policy versions in ``RolloutWorker.apply_weights``
    (``engine.update_weights``: pause, load, reset the prefix cache, resume), summed over versions; updates run
    one at a time, so this is wall time too."""
    other_weight_loads: Callable[[], float] | None = None
    """Seconds of weight loads made outside ``apply_weights`` (lockstep's gate: ``VersionSource.load_s``), read
    at ``as_dict`` and added to its ``weight_apply_s``."""

    def count_rewards(self, task: str, parts: dict) -> None:
        """Add one group's per-reward results (``GroupScore.parts``) to ``reward_parts``."""
        for name, results in parts.items():
            acc = self.reward_parts.setdefault(f"{task}/{name}", [0.0, 0])
            for r in results:
                if not r.error:
                    acc[0] += r.reward
                    acc[1] += 1

    def count_episodes(self, rows) -> None:
        """Add a group's multi-turn episodes (trajectory rows with ``episode_end`` or an ``"episode-"`` error)."""
        for r in rows:
            if not (r.episode_end or r.reward_error.startswith("episode-")):
                continue
            c = self.episodes
            for key, n in (("episodes", 1), ("turns", len(r.turn_starts)), ("tool_calls", r.tool_calls),
                           ("tool_errors", r.tool_errors), ("broken", int(bool(r.reward_error))),
                           (f"end/{r.episode_end or 'broken'}", 1)):
                c[key] = c.get(key, 0) + n

    def as_dict(self, version: int) -> dict:
        """Plain values (``stats()``, ``describe()``, Prometheus, metrics rows): counters, ``tokens_per_s`` since
        start, reward means, spool gauges, and the cumulative seconds of each ``ROLLOUT_PHASES`` phase since the
        worker started (``generate_s``, ``score_s``, ``insert_s``, ``weight_apply_s``; the controller turns them
        into per-step ``time/rollout/*``)."""
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
                "generate_s": self.generate.seconds(), "score_s": self.score.seconds(),
                "insert_s": self.insert.seconds(),
                "weight_apply_s": self.weight_apply_s + (self.other_weight_loads() if self.other_weight_loads else 0.0),
                **(self.spool.stats().as_dict() if self.spool else {}),
                **(self.env_threads.as_dict() if self.env_threads else {}),
                **({"episodes": dict(self.episodes)} if self.episodes else {})}


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
