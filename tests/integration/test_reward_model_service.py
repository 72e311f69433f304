"""The reward-model service without Ray: a tiny random classifier behind the real gRPC server and the rollout's
client — scores equal the model's own forward pass, requests of several rollouts share batches, a service that
is away is waited for up to the deadline and then recorded as ``reward_error``, bad requests are refused."""

import asyncio
import json
import shutil

import pytest
import torch

from gyre.proto import reward_model_pb2
from gyre.rollout.rewards.base import Group, RewardConfig
from gyre.rollout.rewards.combined import make_reward_set
from gyre.rollout.rewards import model as rm
from gyre.rollout.rewards.model import RewardModelError, ScoreItem, model_spec
from gyre.rollout.rewards.math_exact import MATH_EXACT_VERSION
from gyre.services.reward_model.host import RewardModelHost
from gyre.rollout.rewards.scoring import score_groups
from gyre.services.reward_model.config import RewardServiceConfig
from gyre.services.reward_model.server import parse_request, serve
from gyre.services.rollout.reward_client import GrpcRewardModels

PROMPT = [{"role": "user", "content": "What is 2 + 3? Give only the final number."}]


def direct_scores(folder, completions):
    """The classifier's one logit per completion, computed here with transformers alone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for c in completions:
        text = tok.apply_chat_template([*PROMPT, {"role": "assistant", "content": c}], tokenize=False)
        with torch.no_grad():
            out.append(model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item())
    return out


@pytest.fixture
def service(tiny_classifier):
    host = RewardModelHost(batch_size=16)
    server, port, batcher = serve(host, RewardServiceConfig(max_wait_ms=300))
    yield f"127.0.0.1:{port}", batcher, host
    server.stop(grace=0).wait()


def groups(*completions):
    return [Group(list(completions), [PROMPT] * len(completions), {"answer": "5"})]


def test_scores_are_the_classifiers_logits_and_carry_the_model_revision(service, tiny_classifier):
    address, batcher, _ = service
    rm.set_transport(GrpcRewardModels(address))
    try:
        reward_set = make_reward_set([{"model": str(tiny_classifier), "weight": 0.5}, {"name": "math_exact"}])
        [score] = asyncio.run(score_groups([(reward_set, groups("5", "It is 6", "five")[0])]))
    finally:
        rm.set_transport(None)
    expected = direct_scores(tiny_classifier, ["5", "It is 6", "five"])
    got = [r.reward for r in score.results]
    assert got == pytest.approx([0.5 * e + m for e, m in zip(expected, [1.0, 0.0, 0.0])], abs=1e-5)
    assert [r.error for r in score.results] == ["", "", ""]
    version = model_spec(RewardConfig(model=str(tiny_classifier))).version
    assert version.startswith("rm:classifier:") and "@" in version
    assert reward_set.version == f"0.5*{version}+1*{MATH_EXACT_VERSION}"
    assert batcher.counts["responses"] == 3


def test_requests_from_several_rollouts_share_a_batch(service, tiny_classifier):
    address, batcher, _ = service
    reward = rm.ModelReward(RewardConfig(model=str(tiny_classifier)))
    clients = [GrpcRewardModels(address) for _ in range(4)]

    async def main():
        rm.set_transport(None)
        return await asyncio.gather(*(c.score(reward.spec, [ScoreItem(PROMPT, f"answer {i}")], 30)
                                      for i, c in enumerate(clients)))

    results = asyncio.run(main())
    assert all(r[0].error == "" and r[0].version == reward.version for r in results)
    assert batcher.counts["requests"] == 4 and batcher.counts["batches"] < 4


def test_a_service_that_is_away_is_waited_for_then_recorded_as_a_reward_error(tiny_classifier):
    reward = rm.ModelReward(RewardConfig(model=str(tiny_classifier), timeout_s=2.0))
    client = GrpcRewardModels("127.0.0.1:1")  # nothing listens there
    [[result]] = asyncio.run(_score_with(client, reward, groups("5")))
    assert result.reward == 0.0 and result.error.startswith("timeout: reward-model service not reachable")
    assert client.retries >= 2


def test_a_request_waiting_for_a_restarted_service_is_answered_once_it_is_back(tiny_classifier):
    reward = rm.ModelReward(RewardConfig(model=str(tiny_classifier), timeout_s=60.0))
    client = GrpcRewardModels("127.0.0.1:1")

    async def main():
        scoring = asyncio.create_task(_score_with(client, reward, groups("5")))
        await asyncio.sleep(1.5)  # down meanwhile: retried
        server, port, _ = serve(RewardModelHost(), RewardServiceConfig())
        client.set_address(f"127.0.0.1:{port}")  # what the supervisor's push does
        try:
            return await scoring
        finally:
            server.stop(grace=0)

    [[result]] = asyncio.run(main())
    assert result.error == "" and result.version == reward.version and client.retries >= 1


async def _score_with(client, reward, gs):
    rm.set_transport(client)
    try:
        return await reward.score_groups(gs)
    finally:
        rm.set_transport(None)


def test_bad_requests_are_refused_naming_the_value(service, tiny_classifier):
    with pytest.raises(ValueError, match="spec_json 'nope'"):
        parse_request(reward_model_pb2.ScoreRequest(spec_json="nope"), 10)
    spec = model_spec(RewardConfig(model=str(tiny_classifier)))
    bad = reward_model_pb2.ScoreRequest(spec_json=spec.key, items=[reward_model_pb2.ScoreItem(prompt_json="{}")])
    with pytest.raises(ValueError, match=r"items\[0\].prompt_json"):
        parse_request(bad, 10)
    with pytest.raises(ValueError, match="3 items in one request; at most 2"):
        parse_request(reward_model_pb2.ScoreRequest(spec_json=spec.key, items=[bad.items[0]] * 3), 2)


def test_a_model_whose_files_changed_is_refused_by_the_service(service, tiny_classifier, tmp_path):
    address, _, _ = service
    folder = shutil.copytree(tiny_classifier, tmp_path / "rm")
    reward = rm.ModelReward(RewardConfig(model=str(folder)))
    config = json.loads((folder / "config.json").read_text())
    config["num_labels"] = 1
    config["torch_dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config, indent=1))  # other bytes: another revision
    [[result]] = asyncio.run(_score_with(GrpcRewardModels(address), reward, groups("5")))
    assert result.reward == 0.0 and "reward model refused: FAILED_PRECONDITION" in result.error
    assert "revision" in result.error


def test_models_that_do_not_fit_are_refused_before_anything_runs(tiny_llama, tiny_classifier, tmp_path):
    with pytest.raises(RewardModelError, match="not a sequence classifier"):
        rm.ModelReward(RewardConfig(model=str(tiny_llama)))
    with pytest.raises(RewardModelError, match="a classifier cannot be kind 'judge'"):
        rm.ModelReward(RewardConfig(model=str(tiny_classifier), kind="judge"))
    with pytest.raises(RewardModelError, match="no such folder"):
        rm.ModelReward(RewardConfig(model=str(tmp_path / "missing")))
    with pytest.raises(RewardModelError, match="bad params"):
        rm.ModelReward(RewardConfig(model=str(tiny_classifier), params={"max_lenght": 5}))
    with pytest.raises(ValueError, match="parser"):
        rm.JudgeParams(parser="no group")


def test_without_a_service_every_response_is_a_recorded_failure(tiny_classifier):
    reward = rm.ModelReward(RewardConfig(model=str(tiny_classifier)))
    [[a, b]] = asyncio.run(reward.score_groups(groups("1", "2")))
    assert a.reward == b.reward == 0.0 and "no reward-model service" in a.error


def test_a_judge_reply_that_does_not_parse_is_an_error_not_a_zero():
    judge = object.__new__(rm_host_judge())
    judge.params = rm.JudgeParams(parser=r"Score: (\d+)", scale=10)
    judge.pattern = __import__("re").compile(judge.params.parser)
    assert judge.parse("Score: 7") == (0.7, "")
    score, error = judge.parse("I think it's fine")
    assert score == 0.0 and error.startswith("judge reply did not parse: \"I think it's fine\"")


def rm_host_judge():
    from gyre.services.reward_model.host import JudgeScorer

    return JudgeScorer


def test_a_swap_to_a_new_revision_is_loaded_beside_the_old_one(service, tiny_classifier, tmp_path):
    """What ``gyre reward swap`` to a retrained reward model does at the service: groups bound to the old reward
    keep the old revision's scores, later ones get the new revision's, from one service without a restart."""
    from safetensors.torch import load_file, save_file

    from gyre.rollout.tasks import TaskConfig, TaskSource

    address, _, host = service
    new = shutil.copytree(tiny_classifier, tmp_path / "rm-v2")
    weights = load_file(new / "model.safetensors")
    save_file({k: v * 1.5 if k.startswith("score") else v for k, v in weights.items()}, new / "model.safetensors")
    source = TaskSource(TaskConfig(heldout_size=2, reward={"model": str(tiny_classifier)}))
    old_set = source.reward_for("basic_arithmetic")
    versions = source.swap_reward({"model": str(new)})
    new_set = source.reward_for("basic_arithmetic")
    assert versions["basic_arithmetic"] == new_set.version != old_set.version
    assert new_set.version.startswith("rm:classifier:rm-v2@")

    async def both():
        rm.set_transport(GrpcRewardModels(address))
        try:
            return await score_groups([(old_set, groups("5")[0]), (new_set, groups("5")[0])])
        finally:
            rm.set_transport(None)

    old_score, new_score = asyncio.run(both())
    assert old_score.results[0].error == new_score.results[0].error == ""
    assert old_score.results[0].version == old_set.version and new_score.results[0].version == new_set.version
    assert new_score.results[0].reward == pytest.approx(1.5 * old_score.results[0].reward, rel=1e-4)
    assert len(host.loaded) == 2
