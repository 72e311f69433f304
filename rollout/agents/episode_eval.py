"""Held-out evaluation of a multi-turn environment: the same metrics as ``rollout.evaluation`` (greedy accuracy,
mean@k, pass@k per set), each problem answered by a whole episode, plus how the policy used its tools.

An episode's score is what training rewards it with (``rollout.agents.agent_group.EpisodeRunner.rows``): the
environment's reward plus, with ``task_reward``, the task's reward functions on its last model turn; a broken
episode scores 0 with its reason in ``reward_error``. Extra metrics over the greedy episodes:
``heldout_tool_use_rate`` (episodes with at least one tool call), ``heldout_tool_calls_mean``,
``heldout_tool_error_frac`` (failed ÷ calls), ``heldout_turns_mean`` and ``heldout_broken`` (count).
"""

from __future__ import annotations

import asyncio
import time
import uuid
import zlib
from typing import TYPE_CHECKING, Any, Callable

from gyre.rollout.agents.agent_group import EpisodeRunner, episode_reward
from gyre.rollout.config import SamplingConfig
from gyre.rollout.evaluation import EvalConfig, EvalResult, _jsonable, select_sets, summarize
from gyre.rollout.rewards.scoring import score_groups

if TYPE_CHECKING:
    from gyre.rollout.agents.verifiers_env import VerifiersRunner


async def evaluate_episodes(task, engine, runner: EpisodeRunner | VerifiersRunner,
                            prompt_ids: Callable[[Any], list[int]],
                            config: EvalConfig, default_max_new_tokens: int, max_model_len: int) -> EvalResult:
    """``rollout.evaluation.evaluate`` with episodes of ``runner``'s environment on its held-out problems
    (``runner.heldout(task)``: the task's, or a verifiers taskset's held-out tasks; see the module docstring);
    ``max_new_tokens`` is per model turn. Raises ``ValueError`` for an unknown set in ``config.sets``."""
    start, version = time.monotonic(), engine.version
    chosen = select_sets(runner.heldout(task), config.sets)
    budget = config.max_new_tokens or default_max_new_tokens
    k, batch = config.n_samples, uuid.uuid4().hex[:12]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=budget)
    sampled = SamplingConfig(temperature=config.temperature, max_new_tokens=budget)

    def run(i: int, p, n: int, sampling: SamplingConfig, seed: int | None):
        return runner.run_group(engine, p, n, sampling, f"eval-{batch}-{i}-{'g' if seed is None else 's'}",
                                max_model_len, seed, runner.fallback_prompt(p, prompt_ids))

    jobs = [run(i, p, 1, greedy, None) for i, (_, _, p) in enumerate(chosen)]
    jobs += [run(i, p, k, sampled, zlib.crc32(f"{config.seed}-{s}-{j}".encode()))
             for i, (s, j, p) in enumerate(chosen)] if k else []
    results = await asyncio.gather(*jobs)
    greedy_eps, sampled_eps = results[:len(chosen)], results[len(chosen):]
    per_problem = [(where, 0, True, eps[0]) for where, eps in zip(chosen, greedy_eps)]
    per_problem += [(where, i, False, e) for where, eps in zip(chosen, sampled_eps) for i, e in enumerate(eps)]
    scores = [None] * len(per_problem)
    if runner.task_reward:
        groups = [(task.reward_for(p.task), runner.task_group([e], p.entry)) for (_, _, p), _, _, e in per_problem]
        scores = [g.results[0] for g in await score_groups(groups)]
    records = []
    for ((name, j, p), i, is_greedy, e), score in zip(per_problem, scores):
        reward, error = episode_reward(e, score)
        records.append({"set": name, "index": j, "prompt": str(getattr(p, "question", p)),
                        "completion": e.completions[-1] if e.completions else "", "reward": reward,
                        "reward_error": error, "answer": _jsonable(p.entry.get("answer")), "sample": i,
                        "greedy": is_greedy, "finish_reason": e.finish_reason,
                        "versions": sorted(set(e.version_span_versions)), "turns": len(e.completions),
                        "tool_calls": e.tool_calls, "tool_errors": e.tool_errors, "episode_end": e.episode_end,
                        "transcript": e.messages})
    metrics = summarize(records, k)
    metrics.update(tool_metrics([r for r in records if r["greedy"]]))
    metrics.update(version=version, eval_seconds=round(time.monotonic() - start, 3))
    return EvalResult(metrics, records)


def tool_metrics(greedy: list[dict]) -> dict[str, float]:
    """The tool-use metrics of the module docstring over greedy episode records."""
    n = max(len(greedy), 1)
    calls = sum(r["tool_calls"] for r in greedy)
    return {"heldout_tool_use_rate": sum(r["tool_calls"] > 0 for r in greedy) / n,
            "heldout_tool_calls_mean": calls / n,
            "heldout_tool_error_frac": sum(r["tool_errors"] for r in greedy) / calls if calls else 0.0,
            "heldout_turns_mean": sum(r["turns"] for r in greedy) / n,
            "heldout_broken": sum(r["reward_error"].startswith("episode-") for r in greedy)}
