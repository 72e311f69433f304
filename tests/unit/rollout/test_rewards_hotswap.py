"""Reward hot swap and failure recording, through the rollout worker's real scoring path."""

import asyncio

import pytest

from gyre.rollout.config import RolloutConfig, SamplingConfig
from gyre.rollout.evaluation import EvalConfig
from gyre.rollout.rewards.registry import RewardFn, UnknownRewardError, known_rewards, register_reward
from gyre.rollout.tasks import TaskConfig, TaskSource
from gyre.rollout.worker import RolloutWorker
from tests.fakes import FakeEngine, FakeTokenizer

TINY = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
        "allow_parentheses": False, "allow_negation": False}


class Exploding(RewardFn):
    name, version = "test_hotswap_exploding", "exploding-v1"

    def _score(self, response, entry):
        raise RuntimeError(f"verifier crashed on {response!r}")


if Exploding.name not in known_rewards():
    register_reward(Exploding.name, lambda cfg, dataset: Exploding())


class GatedEngine(FakeEngine):
    """Answers every prompt with its ``answer`` text once ``gate`` is set (to hold a group mid-generation)."""

    def __init__(self, texts):
        super().__init__(texts)
        self.gate = asyncio.Event()

    async def generate(self, prompt_token_ids, n, sampling, request_id, seed=None):
        await self.gate.wait()
        return await super().generate(prompt_token_ids, n, sampling, request_id, seed)


def make_worker(task, engine):
    config = RolloutConfig.model_construct(
        engine=None, sampling=SamplingConfig(), group_size=2, groups_in_flight=1, max_ready_groups=4,
        retry_backoff_s=0.01, num_workers=1)
    worker = RolloutWorker("r0", config, task, engine, replay=None, tokenizer=FakeTokenizer(), seed=0)
    delivered = []

    async def capture(table):
        delivered.append(table.to_pylist())

    worker._deliver = capture  # test double for the replay path: keep the rows the worker produced
    return worker, delivered


def test_swap_applies_to_groups_started_after_it():
    task = TaskSource(TaskConfig(params=TINY, heldout_size=4))
    answer = task.problem(0).entry["answer"]
    engine = GatedEngine([f"\\boxed{{{answer}}} and then 99"])
    worker, delivered = make_worker(task, engine)

    async def scenario():
        before = asyncio.create_task(worker._one_group(0, 0))  # started under the old reward
        await asyncio.sleep(0.05)
        versions = worker.swap_reward("math_exact")
        engine.gate.set()
        await before
        await worker._one_group(0, 1)  # started after the swap
        return versions

    assert asyncio.run(scenario()) == {"basic_arithmetic": "math-exact-v1"}
    old, new = delivered
    # last-integer extraction reads 99 (wrong); math_exact reads the box (right)
    assert [(r["reward_fn_version"], r["reward"], r["reward_error"]) for r in old] == [("rg-last-int-exact-v1", 0.0, "")] * 2
    assert [(r["reward_fn_version"], r["reward"], r["reward_error"]) for r in new] == [("math-exact-v1", 1.0, "")] * 2
    assert {r["task"] for r in old + new} == {"basic_arithmetic"}


def test_invalid_swap_is_refused_and_the_old_reward_keeps_scoring():
    task = TaskSource(TaskConfig(mixture={"basic_arithmetic": {"params": TINY}, "chain_sum": 1}, heldout_size=4))
    before = task.reward_versions()
    with pytest.raises(UnknownRewardError, match="unknown reward 'math_exakt'"):
        task.swap_reward({"basic_arithmetic": "math_exakt"})
    with pytest.raises(ValueError, match="reward 'humaneval' does not fit task 'chain_sum'"):
        task.swap_reward({"basic_arithmetic": "math_exact", "chain_sum": "humaneval"})
    with pytest.raises(KeyError, match="unknown task 'countdown'"):
        task.swap_reward({"countdown": "math_exact"})
    with pytest.raises(ValueError, match="mixes \\['basic_arithmetic', 'chain_sum'\\]: pass \\{task: reward\\}"):
        task.swap_reward("math_exact")
    assert task.reward_versions() == before  # nothing half-applied
    assert task.swap_reward({"chain_sum": "math_exact"}) == {"basic_arithmetic": "rg-last-int-exact-v1",
                                                             "chain_sum": "math-exact-v1"}


def test_raising_reward_is_recorded_on_the_trajectory_not_fatal():
    task = TaskSource(TaskConfig(params=TINY, heldout_size=4, reward=Exploding.name))
    worker, delivered = make_worker(task, FakeEngine(["7"]))
    asyncio.run(worker._one_group(3, 0))
    rows = delivered[0]
    assert [(r["reward"], r["reward_fn_version"]) for r in rows] == [(0.0, "exploding-v1")] * 2
    assert rows[0]["reward_error"] == "raised: RuntimeError: verifier crashed on '7'"


def test_evaluate_scores_each_task_with_its_own_reward():
    task = TaskSource(TaskConfig(mixture={"basic_arithmetic": {"params": TINY}, "chain_sum": 1}, heldout_size=2))
    task.swap_reward({"chain_sum": Exploding.name})
    answers = [p.entry["answer"] for p in task.heldout()]
    engine = FakeEngine([])

    async def greedy(prompts, max_new_tokens):
        return [(await FakeEngine([a]).generate(p, 1, None, "eval"))[0] for p, a in zip(prompts, answers)]

    engine.generate_greedy = greedy
    worker, _ = make_worker(task, engine)
    result = asyncio.run(worker.evaluate(EvalConfig(n_samples=0))).metrics
    # arithmetic answers score 1.0; the chain_sum scorer raises, which costs those samples only
    assert (result["heldout_size"], result["heldout_correct"], result["heldout_accuracy"]) == (4, 2, 0.5)
