"""Held-out evaluation: greedy accuracy, mean@k and pass@k per eval set, and every completion kept.

One evaluation scores each held-out problem of the selected sets (``TaskSource.heldout()``; a set is a task
of the mixture, named like it) once greedily (temperature 0) and, with ``n_samples = k > 0``, ``k`` times at
``temperature`` with a seed of its own. A response is *correct* when its score is >= 1.0 (exact; a verifier's
partial credit is not correct); a response whose scoring failed (``reward_error``) has reward 0 and is not
correct. Used by the rollout service (``RolloutWorker.evaluate``, before/during/after training) and by
``gyre eval`` (``services.cli.standalone_eval``); the engine is anything with ``version``, ``generate`` and
``generate_greedy`` (``rollout.engine.RolloutEngine``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gyre.rollout.config import SamplingConfig
from gyre.rollout.rewards.base import Group
from gyre.rollout.rewards.scoring import score_groups

EXACT = 1.0
"""A score at or above this is a correct answer."""


class EvalConfig(BaseModel):
    """The recipe's ``eval:`` section: when to evaluate, on which held-out sets, and how."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    every_steps: int | None = Field(None, ge=0)
    """Evaluate during training each time the learner's version crosses a multiple of this (versions strictly
    between the start and ``num_steps``; the final one is ``after``'s). ``None`` or 0: only before/after."""
    before: bool = True
    """Evaluate the initial policy (version 0) before training (skipped on resume)."""
    after: bool = True
    """Evaluate the final policy version after training."""
    sets: list[str] | None = None
    """Held-out sets to evaluate: task names of the recipe's task (a mixture's component names). ``None``: all."""
    n_samples: int = Field(1, ge=0)
    """``k`` of mean@k and pass@k: samples per problem at ``temperature``. 0: greedy accuracy only."""
    temperature: float = Field(1.0, gt=0)
    """Softmax temperature of the ``k`` samples (greedy accuracy always uses temperature 0)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Token budget of every evaluation response. ``None`` (in a recipe): ``rollout.sampling.max_new_tokens``,
    the training budget (the recipe loader fills it in)."""
    seed: int = 0
    """Base of the samples' seeds: problem ``j`` of set ``s`` samples with seeds ``crc32(f"{seed}-{s}-{j}") + i``."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from ``n`` samples of which ``c`` are correct (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code", eq. 1): ``1 - C(n-c, k) / C(n, k)``, the chance that
    ``k`` of the ``n`` samples drawn without replacement hold at least one correct one; computed as
    ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` (their numerically stable form). With ``n == k``: 1.0 if ``c > 0``.

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c ({c}) <= n ({n}) and 1 <= k ({k}) <= n")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_at_k(rewards: Sequence[Sequence[float]]) -> float:
    """mean@k: the mean reward of ``k`` samples per problem, averaged over problems (``rewards[p][i]``: reward
    of sample ``i`` of problem ``p``, partial credit included). 0.0 for no problems.

    Raises:
        ValueError: a problem with no samples.
    """
    if any(len(r) == 0 for r in rewards):
        raise ValueError("every problem needs at least one sample for mean@k")
    return sum(sum(r) / len(r) for r in rewards) / len(rewards) if rewards else 0.0


@dataclass(frozen=True)
class EvalResult:
    """What one evaluation returns (JSON-serialisable contents: it crosses Ray and lands in files)."""

    metrics: dict[str, Any]
    """One ``metrics.jsonl`` row's values (no ``step``/``time``): ``heldout_accuracy`` (greedy, exact, all sets),
    ``heldout_correct``, ``heldout_size``, ``heldout_score_mean``, ``version`` (the engine's when it started),
    ``eval_seconds``, with ``k > 0`` ``heldout_mean@k`` / ``heldout_pass@k``; per set ``eval/<set>/greedy_accuracy``,
    ``eval/<set>/size``, ``eval/<set>/reward_errors`` and with ``k > 0`` ``eval/<set>/mean@k``, ``eval/<set>/pass@k``."""
    completions: list[dict]
    """One record per (problem, sample), greedy first: ``set``, ``index`` (in its set), ``prompt`` (the user
    message), ``completion``, ``reward``, ``reward_error`` (``""``: scored), ``answer`` (the entry's, or None),
    ``sample`` (0 for greedy), ``greedy``, ``finish_reason``, ``versions`` (policy versions that sampled it)."""


def select_sets(problems: Sequence, sets: Sequence[str] | None) -> list[tuple[str, int, Any]]:
    """``(set, index in set, problem)`` for the held-out ``problems`` (each with a ``task``) of ``sets``
    (``None``: all), in order.

    Raises:
        ValueError: a set name that is not a task of these problems (the known ones are named).
    """
    known = list(dict.fromkeys(p.task for p in problems))
    unknown = sorted(set(sets or []) - set(known))
    if unknown:
        raise ValueError(f"eval.sets {unknown} are not held-out sets of this task; expected some of {known}")
    counts: dict[str, int] = {}
    out = []
    for p in problems:
        if sets is None or p.task in sets:
            out.append((p.task, counts.get(p.task, 0), p))
            counts[p.task] = counts.get(p.task, 0) + 1
    return out


async def evaluate(task, engine, prompt_ids: Callable[[Any], list[int]], config: EvalConfig,
                   default_max_new_tokens: int) -> EvalResult:
    """Run one evaluation of ``task``'s held-out sets (see the module docstring) with ``engine``'s weights.

    Args:
        task: a ``rollout.tasks.TaskSource`` (``heldout()``, ``reward_for(task)``, ``messages(problem)``).
        prompt_ids: problem -> prompt token ids (the chat template the training prompts use).
        default_max_new_tokens: budget when ``config.max_new_tokens`` is None (the training one).
    Raises:
        ValueError: an unknown set in ``config.sets``, or a prompt the engine refuses (too long).
    """
    start, version = time.monotonic(), engine.version
    chosen = select_sets(task.heldout(), config.sets)
    budget = config.max_new_tokens or default_max_new_tokens
    prompts = [prompt_ids(p) for _, _, p in chosen]
    k, batch = config.n_samples, uuid.uuid4().hex[:12]
    sampling = SamplingConfig(temperature=config.temperature, max_new_tokens=budget)
    sampled = [engine.generate(ids, k, sampling, request_id=f"eval-{batch}-{i}",
                               seed=zlib.crc32(f"{config.seed}-{s}-{j}".encode()))
               for i, ((s, j, _), ids) in enumerate(zip(chosen, prompts))] if k else []
    greedy, *groups = await asyncio.gather(engine.generate_greedy(prompts, budget), *sampled)
    items = [(where, 0, True, g) for where, g in zip(chosen, greedy)]
    items += [(where, i, False, s) for where, group in zip(chosen, groups) for i, s in enumerate(group)]
    groups = [(task.reward_for(p.task), Group([s.text], [task.messages(p)], p.entry, [list(s.token_ids)]))
              for (_, _, p), _, _, s in items]  # one completion per call: a function reward sees n = 1
    scores = [g.results[0] for g in await score_groups(groups)]
    records = [{"set": name, "index": j, "prompt": task.messages(p)[-1]["content"], "completion": s.text,
                "reward": r.reward, "reward_error": r.error, "answer": _jsonable(p.entry.get("answer")),
                "sample": i, "greedy": greedy_flag, "finish_reason": s.finish_reason,
                "versions": sorted(set(s.version_span_versions))}
               for ((name, j, p), i, greedy_flag, s), r in zip(items, scores)]
    metrics = summarize(records, k)
    metrics.update(version=version, eval_seconds=round(time.monotonic() - start, 3))
    return EvalResult(metrics, records)


def summarize(records: Sequence[dict], k: int) -> dict[str, Any]:
    """The metrics of ``EvalResult.metrics`` (without ``version``/``eval_seconds``) from its completion
    records; ``k`` is ``n_samples`` (each problem has exactly ``k`` non-greedy records)."""
    out: dict[str, Any] = {}
    greedy = [r for r in records if r["greedy"]]
    correct = sum(r["reward"] >= EXACT for r in greedy)
    out.update(heldout_accuracy=correct / max(len(greedy), 1), heldout_correct=correct, heldout_size=len(greedy),
               heldout_score_mean=sum(r["reward"] for r in greedy) / max(len(greedy), 1))
    by_set: dict[str, dict[int, list[dict]]] = {}
    for r in records:
        if not r["greedy"]:
            by_set.setdefault(r["set"], {}).setdefault(r["index"], []).append(r)
    all_rewards, all_pass = [], []
    for name in dict.fromkeys(r["set"] for r in greedy):
        mine = [r for r in greedy if r["set"] == name]
        out[f"eval/{name}/greedy_accuracy"] = sum(r["reward"] >= EXACT for r in mine) / len(mine)
        out[f"eval/{name}/size"] = len(mine)
        out[f"eval/{name}/reward_errors"] = sum(bool(r["reward_error"]) for r in records if r["set"] == name)
        if k:
            groups = list(by_set.get(name, {}).values())
            rewards = [[r["reward"] for r in g] for g in groups]
            passes = [pass_at_k(len(g), sum(r["reward"] >= EXACT for r in g), k) for g in groups]
            out[f"eval/{name}/mean@{k}"] = mean_at_k(rewards)
            out[f"eval/{name}/pass@{k}"] = sum(passes) / len(passes)
            all_rewards += rewards
            all_pass += passes
    if k and all_pass:
        out[f"heldout_mean@{k}"] = mean_at_k(all_rewards)
        out[f"heldout_pass@{k}"] = sum(all_pass) / len(all_pass)
    return out


def _jsonable(value: Any) -> Any:
    """``value`` if JSON can hold it, else its ``str``."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def resolve_recipe_eval(data: dict) -> dict:
    """The recipe loader's step for the ``eval:`` section (on the raw recipe mapping; returns a new one):
    the old keys are aliases — top-level ``eval_before`` / ``eval_after`` become ``eval.before`` / ``eval.after``
    and ``rollout.eval_max_new_tokens`` becomes ``eval.max_new_tokens`` — and an unset ``eval.max_new_tokens``
    takes ``rollout.sampling.max_new_tokens`` (the training budget).

    Raises:
        ValueError: an old key and its new one both set, or ``eval`` not a mapping.
    """
    data = dict(data)
    section = data.get("eval", {})
    if not isinstance(section, dict):
        raise ValueError(f"eval must be a mapping (every_steps, before, after, sets, n_samples, temperature, "
                         f"max_new_tokens, seed), got {section!r}")
    section = dict(section)
    rollout = data.get("rollout")
    moves = [("eval_before", "before", data), ("eval_after", "after", data)]
    if isinstance(rollout, dict):
        rollout = data["rollout"] = dict(rollout)
        moves.append(("eval_max_new_tokens", "max_new_tokens", rollout))
    for old, new, parent in moves:
        if old in parent:
            if new in section:
                where = "rollout." if parent is rollout else ""
                raise ValueError(f"{where}{old} is the old name of eval.{new}: set only eval.{new}")
            section[new] = parent.pop(old)
    if section.get("max_new_tokens") is None and isinstance(rollout, dict):
        sampling = rollout.get("sampling", {})
        budget = sampling.get("max_new_tokens") if isinstance(sampling, dict) else None
        section["max_new_tokens"] = budget if type(budget) is int else SamplingConfig().max_new_tokens
    data["eval"] = section
    return data
