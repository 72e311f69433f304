"""A generative judge on real vLLM (CPU) with the tiny random Llama: the reward is exactly what the parser reads
from the judge's own greedy reply, and a reply the parser finds no score in is a recorded ``reward_error``."""

import pytest

from gyre.rollout.rewards.base import RewardConfig
from gyre.rollout.rewards.model import ScoreItem, model_spec
from gyre.services.reward_model.host import RewardModelHost

PROMPT = [{"role": "user", "content": "What is 2 + 3? Give only the final number."}]
SMALL = {"max_tokens": 8, "max_model_len": 256, "kv_cache_gib": 0.25}


@pytest.fixture(scope="module")
def host(vllm_worker_process):
    """vLLM's engine core in its own process, as in the service (vLLM's default): in-process, vLLM's triton
    dispatcher scans every loaded module and trips over e.g. Flask's ``current_app`` proxy left by moto's server
    (imported here, so the test holds whatever ran before it in the same pytest worker)."""
    import flask  # noqa: F401

    return RewardModelHost(batch_size=4, max_models=1)


def test_the_judge_score_is_what_the_parser_reads_from_its_own_reply(host, tiny_llama):
    spec = model_spec(RewardConfig(model=str(tiny_llama), kind="judge",
                                   params={**SMALL, "template": "Q: {question}\nA: {completion}\nRef: {reference}"}))
    items = [ScoreItem(PROMPT, c, "5") for c in ("5", "6", "seven")]
    results = host.score(spec, items)
    judge = host.load(spec)
    prompt = judge.prompt(items[0])
    assert "Q: What is 2 + 3? Give only the final number.\nA: 5\nRef: 5" in prompt
    replies = [o.outputs[0].text for o in judge.llm.generate([judge.prompt_ids(i) for i in items], judge.sampling,
                                                              use_tqdm=False)]
    assert results == [judge.parse(r) for r in replies]  # greedy: the same replies again


def test_a_reply_without_a_score_is_a_recorded_error(host, tiny_llama):
    spec = model_spec(RewardConfig(model=str(tiny_llama), kind="judge",
                                   params={**SMALL, "parser": r"FINAL SCORE=(\d+)"}))
    results = host.score(spec, [ScoreItem(PROMPT, "5")])
    assert len(host.loaded) == 1  # max_models 1: the first judge was dropped to load this one
    [(reward, error)] = results
    assert reward == 0.0 and error.startswith("judge reply did not parse:") and "FINAL SCORE" in error
