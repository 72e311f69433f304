"""Reward registry: lookup by name, versions, math normalisation, and failures that never kill the caller."""

import asyncio
import time

import pytest

from gyre.rollout.rewards.math_exact import extract_final_answer, math_exact_match, normalize
from gyre.rollout.rewards.registry import (RewardConfig, RewardFn, UnknownRewardError, known_rewards, make_reward,
                                      register_reward)
from gyre.rollout.rewards.base import score_many


class Raising(RewardFn):
    name, version = "test_raising", "raising-v1"

    def _score(self, response, entry):
        return 1 / 0, ""


class Sleeping(RewardFn):
    name, version = "test_sleeping", "sleeping-v1"

    def _score(self, response, entry):
        time.sleep(1.0)
        return 1.0, ""


def test_lookup_by_name_gives_versioned_scorers():
    arith = make_reward("reasoning_gym:basic_arithmetic")
    assert (arith.name, arith.version) == ("reasoning_gym:basic_arithmetic", "rg-last-int-exact-v1")
    entry = {"question": "Calculate 2 + 3.", "answer": "5", "metadata": {}}
    assert arith.score("It is 5", entry).reward == 1.0 and arith.score("It is 6", entry).reward == 0.0
    tagged = make_reward({"name": "reasoning_gym:basic_arithmetic", "params": {"extract": "answer_tag"}})
    assert tagged.version == "rg-answer-tag-exact-v1" and tagged.score("3 <answer>5</answer> 7", entry).reward == 1.0
    assert make_reward("math_exact").version == "math-exact-v1"
    assert make_reward({"name": "humaneval", "params": {"sandbox": {"timeout_s": 2}}}).sandbox.timeout_s == 2
    countdown = make_reward("reasoning_gym:countdown")  # any reasoning-gym dataset works by name
    assert countdown.name == "reasoning_gym:countdown"


def test_unknown_names_list_the_known_ones():
    with pytest.raises(UnknownRewardError) as err:
        make_reward("exact_math")
    message = str(err.value)  # other test modules may have registered more names
    assert message.startswith("unknown reward 'exact_math'; known: char_fraction, humaneval, math_exact, ")
    assert message.endswith(", reasoning_gym:<dataset>")
    with pytest.raises(UnknownRewardError, match="'arithmetic_typo' is not a reasoning-gym dataset.*basic_arithmetic"):
        make_reward("reasoning_gym:arithmetic_typo")
    with pytest.raises(ValueError, match="bad params"):
        make_reward({"name": "reasoning_gym:basic_arithmetic", "params": {"extract": "first_word"}})
    with pytest.raises(ValueError, match="bad params"):
        make_reward({"name": "math_exact", "params": {"tolerance": 0.1}})
    assert "math_exact" in known_rewards()


def test_char_fraction_is_a_dense_graded_score_of_the_response_alone():
    reward = make_reward({"name": "char_fraction", "params": {"chars": "0123456789 "}})
    assert reward.score("12 ab", {}).reward == pytest.approx(3 / 5)  # '1', '2', ' ' of 5 characters
    assert reward.score("", {}).reward == 0.0 and reward.score("xyz", {}).reward == 0.0
    assert reward.score("4 2", {}).reward == 1.0
    reward.check_entry({})  # reads nothing of the problem
    # the version names the character set, whatever its order or repeats
    assert reward.version == make_reward({"name": "char_fraction", "params": {"chars": " 9876543210 "}}).version
    assert reward.version != make_reward({"name": "char_fraction", "params": {"chars": "0123456789"}}).version
    with pytest.raises(ValueError, match="bad params"):
        make_reward({"name": "char_fraction", "params": {"chars": ""}})
    with pytest.raises(ValueError, match="bad params"):
        make_reward("char_fraction")  # chars is required


@pytest.mark.parametrize("response, reference, expected", [
    ("The answer is 42.", "42", True),
    ("$\\boxed{42}$", "42", True),
    ("so \\boxed{1,234} in total", "1234", True),
    ("It is 3.0", "3", True),
    ("It is 3.50", "7/2", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{-\\dfrac{6}{4}}", "-1.5", True),
    ("x = -2/4", "-0.5", True),
    ("Answer: 41", "42", False),
    ("\\boxed{42} but maybe 41", "42", True),  # the box wins over a later number
    ("\\boxed{(1,2)}", "(1, 2)", True),  # not a thousands separator: the comma stays
    ("\\boxed{(1,2)}", "(2, 1)", False),
    ("\\boxed{x+1}", "x + 1", True),
    ("no number here", "42", False),
    ("1,000,000 ways", "1000000", True),
    ("0.1 + 0.2 = 0.3", "0.3", True),
])
def test_math_exact_normalisation_table(response, reference, expected):
    assert math_exact_match(response, reference) is expected


def test_math_exact_pieces():
    assert normalize(" $\\boxed{1,234.}$ ") == "1234"
    assert extract_final_answer("first \\boxed{a{b}c} then \\boxed{7}") == "7"
    assert extract_final_answer("nested \\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    assert extract_final_answer("total 12, then 1,500") == "1500"


def test_raising_scorer_gives_zero_and_a_recorded_error():
    result = Raising().score("anything", {"answer": "1"})
    assert (result.reward, result.version) == (0.0, "raising-v1")
    assert result.error == "raised: ZeroDivisionError: division by zero"


def test_timed_out_scorer_gives_zero_and_the_loop_stays_free():
    slow, ok = Sleeping(), make_reward("math_exact")
    slow.timeout_s = 0.2

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.create_task(ticker())
        results = await score_many([(slow, "x", {}), (ok, "\\boxed{2}", {"answer": "2"})])
        tick.cancel()
        return results, ticks

    (late, good), ticks = asyncio.run(main())
    assert (late.reward, late.version) == (0.0, "sleeping-v1") and late.error.startswith("timeout: not scored within")
    assert (good.reward, good.error) == (1.0, "")
    assert ticks >= 5  # the event loop kept running while the scorer slept


def test_registered_reward_is_found_and_names_are_unique():
    register_reward("test_registry_raising", lambda cfg, dataset: Raising())
    assert make_reward(RewardConfig(name="test_registry_raising", timeout_s=3)).timeout_s == 3
    with pytest.raises(ValueError, match="already taken"):
        register_reward("test_registry_raising", lambda cfg, dataset: Raising())


def test_reasoning_gym_rewards_are_exact_unless_a_recipe_asks_for_partial_credit():
    entry = {"question": "Calculate 2 + 3.", "answer": "5", "metadata": {}}
    exact = make_reward("reasoning_gym:basic_arithmetic")
    assert exact.version == "rg-last-int-exact-v1"
    # reasoning-gym's score_answer gives 0.5 when the oracle is a substring: "15" and "-5" for "5"
    assert [exact.score(t, entry).reward for t in ("It is 15", "It is -5", "It is 5", "6")] == [0.0, 0.0, 1.0, 0.0]
    partial = make_reward({"name": "reasoning_gym:basic_arithmetic", "params": {"partial_credit": True}})
    assert partial.version == "rg-last-int-v1"
    assert [partial.score(t, entry).reward for t in ("It is 15", "It is -5", "It is 5", "6")] == [0.5, 0.5, 1.0, 0.0]
    tagged = make_reward({"name": "reasoning_gym:basic_arithmetic", "params": {"extract": "full"}})
    assert tagged.version == "rg-full-exact-v1" and tagged.score("5.0", entry).reward == 0.0


def test_math_verify_scores_boxed_latex_in_the_scoring_threads():
    reward = make_reward("math_verify")
    assert reward.version == "math-verify-v1"
    entry = {"answer": "\\frac{1}{3}"}
    texts = ["so the answer is \\boxed{\\frac{1}{3}}", "\\boxed{\\dfrac{2}{6}}", "$\\boxed{0.5}$", "\\boxed{1/3}",
             "it is 1/3 I think"]  # last: no LaTeX anchor, as TRL's accuracy_reward
    results = asyncio.run(score_many([(reward, t, entry) for t in texts]))  # off the main thread
    assert [(r.reward, r.error) for r in results] == [(1.0, ""), (1.0, ""), (0.0, ""), (1.0, ""), (0.0, "")]
    assert asyncio.run(score_many([(reward, "\\boxed{5}", {"answer": "5"})]))[0].reward == 1.0
    (unparsed,) = asyncio.run(score_many([(reward, "\\boxed{5}", {"answer": "no number here"})]))
    assert (unparsed.reward, unparsed.error) == (0.0, "gold answer 'no number here' does not parse")
    with pytest.raises(ValueError, match="bad params"):
        make_reward({"name": "math_verify", "params": {"strict": False}})
