"""Hand-written test doubles and builders, in one module (house style §8)."""

from __future__ import annotations

from proto.trajectory import Trajectory, make_ids, to_table


def make_group(prompt_index: int, n: int = 4, attempt: int = 0, version: int = 0, rewards=None,
               response_len: int = 3, spans: tuple[list[int], list[int]] | None = None) -> list[Trajectory]:
    """``n`` trajectories of one prompt (a GRPO group) with simple deterministic contents."""
    rewards = rewards if rewards is not None else [float(i % 2) for i in range(n)]
    out = []
    for s in range(n):
        tid, gid = make_ids(prompt_index, s, attempt)
        starts, versions = spans if spans else ([0], [version])
        out.append(Trajectory(
            trajectory_id=tid, group_id=gid, prompt_index=prompt_index, sample_index=s, attempt=attempt,
            task="basic_arithmetic", prompt_token_ids=[1, 2, 3], response_token_ids=list(range(10, 10 + response_len)),
            behaviour_logprobs=[-0.5] * response_len, reward=rewards[s], finish_reason="stop",
            version_span_starts=list(starts), version_span_versions=list(versions),
            reward_fn_version="test", rollout_id="r0", created_at=0.0))
    return out


def group_table(prompt_index: int, **kw):
    return to_table(make_group(prompt_index, **kw))


class FakeClock:
    """Monotonic clock under the test's control (seconds)."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt
