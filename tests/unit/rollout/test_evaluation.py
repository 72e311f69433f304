"""Held-out evaluation (``rollout.evaluation``): pass@k / mean@k against hand-computed values, and one
evaluation of a two-set mixture with a scripted engine (per-set metrics, completion records, budgets, seeds)."""

import asyncio
import json
import math

import pytest

from gyre.rollout.evaluation import EvalConfig, evaluate, mean_at_k, pass_at_k, select_sets, summarize
from gyre.rollout.tasks import TaskConfig, TaskSource
from gyre.rollout.types import Sample
from tests.fakes import FakeTokenizer

TINY = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"], "allow_parentheses": False,
        "allow_negation": False}


@pytest.mark.parametrize("n, c, k, want", [
    (5, 2, 2, 1 - 3 / 10),      # 1 - C(3,2)/C(5,2)
    (10, 3, 5, 1 - 21 / 252),   # 1 - C(7,5)/C(10,5)
    (4, 1, 1, 0.25),            # pass@1 = c/n
    (4, 0, 4, 0.0), (4, 1, 4, 1.0), (4, 4, 4, 1.0),  # n == k: any correct
    (3, 2, 2, 1.0),             # n - c < k: every draw of 2 holds a correct one
])
def test_pass_at_k_matches_hand_computed_values(n, c, k, want):
    assert math.isclose(pass_at_k(n, c, k), want, abs_tol=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match=f"c \\({c}\\)"):
        pass_at_k(n, c, k)


def test_mean_at_k_averages_per_problem_then_over_problems():
    assert mean_at_k([[1.0, 0.5], [0.0, 0.0], [1.0, 1.0]]) == pytest.approx((0.75 + 0.0 + 1.0) / 3)
    assert mean_at_k([]) == 0.0
    with pytest.raises(ValueError, match="at least one sample"):
        mean_at_k([[1.0], []])


def _sample(text, version=3):
    return Sample([1], [-0.1], "stop", [0], [version], text=text)


class ScriptedEngine:
    """Answers each prompt (by position in the evaluation) from a script; records budgets and seeds."""

    def __init__(self, greedy: list[str], sampled: list[list[str]], version: int = 3) -> None:
        self.greedy, self.sampled, self.version = greedy, sampled, version
        self.budgets, self.seeds, self.temperatures = [], [], []

    async def generate_greedy(self, prompts, max_new_tokens):
        self.budgets.append(("greedy", max_new_tokens))
        return [_sample(t) for t in self.greedy[:len(prompts)]]

    async def generate(self, prompt_ids, n, sampling, request_id, seed=None):
        i = int(request_id.rsplit("-", 1)[1])
        self.budgets.append(("sampled", sampling.max_new_tokens))
        self.seeds.append(seed)
        self.temperatures.append(sampling.temperature)
        return [_sample(t) for t in self.sampled[i][:n]]


def _mixture():
    return TaskSource(TaskConfig(mixture={"basic_arithmetic": {"params": TINY}, "chain_sum": 1}, heldout_size=2))


def _prompt_ids(problem):
    return FakeTokenizer().apply_chat_template([{"content": problem.question}])


def test_one_evaluation_reports_each_set_and_keeps_every_completion():
    task = _mixture()
    answers = [p.entry["answer"] for p in task.heldout()]  # arithmetic 0, 1, then chain_sum 0, 1
    assert [p.task for p in task.heldout()] == ["basic_arithmetic"] * 2 + ["chain_sum"] * 2
    engine = ScriptedEngine(
        greedy=[answers[0], "no", answers[2], answers[3]],
        sampled=[[answers[0], "x", "x"], ["x", "x", "x"], [answers[2]] * 3, ["x", answers[3], "x"]])
    result = asyncio.run(evaluate(task, engine, _prompt_ids, EvalConfig(n_samples=3, temperature=0.7), 24))
    m = result.metrics
    assert (m["heldout_accuracy"], m["heldout_correct"], m["heldout_size"], m["version"]) == (0.75, 3, 4, 3)
    assert m["eval/basic_arithmetic/greedy_accuracy"] == 0.5 and m["eval/chain_sum/greedy_accuracy"] == 1.0
    assert m["eval/basic_arithmetic/size"] == m["eval/chain_sum/size"] == 2
    # basic_arithmetic: 1 of 3 and 0 of 3 correct; chain_sum: 3 of 3 and 1 of 3 (rewards are 0/1 here)
    assert m["eval/basic_arithmetic/mean@3"] == pytest.approx((1 / 3 + 0) / 2)
    assert m["eval/basic_arithmetic/pass@3"] == 0.5 and m["eval/chain_sum/pass@3"] == 1.0
    assert m["eval/chain_sum/mean@3"] == pytest.approx((1 + 1 / 3) / 2)
    assert m["heldout_pass@3"] == 0.75 and m["heldout_mean@3"] == pytest.approx((1 / 3 + 0 + 1 + 1 / 3) / 4)
    assert m["eval/basic_arithmetic/reward_errors"] == 0

    records = result.completions
    assert len(records) == 4 * (1 + 3)
    assert [(r["set"], r["index"], r["sample"], r["greedy"]) for r in records[:4]] == [
        ("basic_arithmetic", 0, 0, True), ("basic_arithmetic", 1, 0, True), ("chain_sum", 0, 0, True),
        ("chain_sum", 1, 0, True)]
    first = records[4]
    assert (first["set"], first["index"], first["sample"], first["greedy"]) == ("basic_arithmetic", 0, 0, False)
    assert first["completion"] == answers[0] and first["reward"] == 1.0 and first["reward_error"] == ""
    assert first["answer"] == answers[0] and first["versions"] == [3] and first["finish_reason"] == "stop"
    assert first["prompt"].startswith(task.heldout()[0].question) and first["prompt"].endswith("final number.")
    json.dumps(records)  # the payload crosses Ray and lands in a JSONL file
    # the budget and the temperature reached the engine; each problem has a seed of its own
    assert set(engine.budgets) == {("greedy", 24), ("sampled", 24)} and set(engine.temperatures) == {0.7}
    assert len(set(engine.seeds)) == 4


def test_sets_budget_and_seeds_follow_the_config():
    task = _mixture()
    engine = ScriptedEngine(greedy=["x"] * 2, sampled=[["x"] * 2] * 2)
    cfg = EvalConfig(sets=["chain_sum"], n_samples=2, max_new_tokens=5, seed=11)
    result = asyncio.run(evaluate(task, engine, _prompt_ids, cfg, 24))
    assert {r["set"] for r in result.completions} == {"chain_sum"} and result.metrics["heldout_size"] == 2
    assert not any(k.startswith("eval/basic_arithmetic/") for k in result.metrics)
    assert set(engine.budgets) == {("greedy", 5), ("sampled", 5)}
    again = ScriptedEngine(greedy=["x"] * 2, sampled=[["x"] * 2] * 2)
    asyncio.run(evaluate(task, again, _prompt_ids, cfg, 24))
    assert again.seeds == engine.seeds  # the same problems sample with the same seeds every evaluation
    other = ScriptedEngine(greedy=["x"] * 2, sampled=[["x"] * 2] * 2)
    asyncio.run(evaluate(task, other, _prompt_ids, cfg.model_copy(update={"seed": 12}), 24))
    assert set(other.seeds).isdisjoint(engine.seeds)


def test_greedy_only_and_an_unknown_set():
    task = _mixture()
    engine = ScriptedEngine(greedy=["x"] * 4, sampled=[])
    result = asyncio.run(evaluate(task, engine, _prompt_ids, EvalConfig(n_samples=0), 24))
    assert len(result.completions) == 4 and engine.seeds == []
    assert not any("@" in k for k in result.metrics)
    with pytest.raises(ValueError, match=r"eval.sets \['gsm8k'\] are not held-out sets .*'basic_arithmetic'"):
        select_sets(task.heldout(), ["gsm8k", "chain_sum"])


def test_a_failed_score_counts_as_wrong_and_partial_credit_is_not_correct():
    records = [{"set": "a", "index": 0, "greedy": True, "reward": 0.0, "reward_error": "timeout: 30 s"},
               {"set": "a", "index": 1, "greedy": True, "reward": 0.5, "reward_error": ""},
               {"set": "a", "index": 0, "greedy": False, "reward": 1.0, "reward_error": ""},
               {"set": "a", "index": 0, "greedy": False, "reward": 0.0, "reward_error": "ValueError: x"},
               {"set": "a", "index": 1, "greedy": False, "reward": 0.5, "reward_error": ""},
               {"set": "a", "index": 1, "greedy": False, "reward": 0.5, "reward_error": ""}]
    m = summarize(records, 2)
    assert m["eval/a/reward_errors"] == 2 and m["heldout_accuracy"] == 0.0 and m["heldout_score_mean"] == 0.25
    assert m["eval/a/pass@2"] == 0.5  # problem 1's samples have partial credit only: not correct
    assert m["eval/a/mean@2"] == pytest.approx((0.5 + 0.5) / 2)  # mean@k keeps the partial credit
