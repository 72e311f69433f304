"""The verifiers adapter (``rollout.agents.verifiers_env``) with real vLLM, the tiny Llama and a verifiers v1 environment
written here: a scripted user's two turns, with the learner's next policy arriving between them."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

from gyre.rollout.config import SamplingConfig
from gyre.rollout.engine import RolloutEngine
from tests.integration.test_engine import Running, Spy, engine_config, perturbed

pytest.importorskip("verifiers.v1")

TASKSET = textwrap.dedent('''
    """Two user turns: the scripted user says a word, then another; reward 1 when the reply has 2+ characters."""
    import verifiers.v1 as vf

    BETWEEN_TURNS = []  # async callables the test runs between the two user turns (a weight update)


    class EchoData(vf.TaskData):
        words: list[str]


    class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
        @vf.reward(weight=1.0)
        async def replied(self, trace: vf.Trace) -> float:
            return float(len(trace.assistant_messages) == 2)


    class TwoTurnEnv(vf.SingleAgentEnv):
        async def run(self, task, agents):
            async with agents.agent.interaction(task) as interaction:
                for i, word in enumerate(task.data.words):
                    if i:
                        for hook in BETWEEN_TURNS:
                            await hook()
                    if (await interaction.turn(word)).terminated:
                        break


    class TwoTurnTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
        def load(self):
            return [EchoTask(EchoData(idx=i, prompt=None, system_prompt="Repeat the user.", words=w))
                    for i, w in enumerate([["hello", "world"], ["red", "blue"]])]


    __all__ = ["TwoTurnEnv", "TwoTurnTaskset"]
''')


@pytest.fixture(scope="module")
def taskset(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vf-taskset")
    (folder / "gyre_vf_two_turn.py").write_text(TASKSET)
    sys.path.insert(0, str(folder))
    import gyre_vf_two_turn

    yield gyre_vf_two_turn
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def running(tiny_llama, vllm_worker_process):
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(RolloutEngine.start(engine_config(tiny_llama), initial_version=3))
    yield Running(engine, loop)
    loop.run_until_complete(engine.shutdown())
    loop.close()


def runner_for(tiny_llama, **kw):
    from transformers import AutoTokenizer

    from gyre.rollout.agents.environment import VerifiersConfig
    from gyre.rollout.agents.verifiers_env import VerifiersRunner

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    return VerifiersRunner(VerifiersConfig(taskset="gyre_vf_two_turn", **kw), str(tiny_llama), tok), tok


def test_verifiers_episode_is_token_exact_across_a_weight_update(running, taskset, tiny_llama):
    from safetensors.torch import load_file

    from gyre.proto.trajectory import from_table, to_table

    runner, tok = runner_for(tiny_llama)
    original = sorted(load_file(tiny_llama / "model.safetensors").items())
    engine, v = running.engine, running.engine.version
    spy = Spy(engine)

    async def update():  # the learner's next policy arrives between the user's two turns
        await engine.update_weights(engine.version + 1, perturbed(original, seed=4))

    taskset.BETWEEN_TURNS[:] = [update]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
    try:
        (ep,) = running.run(runner.run_group(spy, None, 1, sampling, "g-0", 1024, seed=7, fallback_prompt=[1],
                                             prompt_index=0))
    finally:
        taskset.BETWEEN_TURNS.clear()
        running.run(runner.close())
        running.run(engine.update_weights(engine.version + 1, original))
    assert (ep.error, ep.episode_end, ep.reward) == ("", "done", 1.0)
    (ctx1, (s1,)), (ctx2, (s2,)) = spy.calls
    first = tok.apply_chat_template([{"role": "system", "content": "Repeat the user."},
                                     {"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False)
    assert ctx1 == ep.prompt_token_ids == tok.encode(first, add_special_tokens=False)
    # turn 2's prompt extends turn 1's context by exactly the template's next user turn (closing a cut turn 1)
    closed = s1.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    obs = tok.encode(("" if closed else "<|im_end|>") + "\n<|im_start|>user\nworld<|im_end|>\n<|im_start|>assistant\n",
                     add_special_tokens=False)
    assert ctx2 == ctx1 + s1.token_ids + obs
    # token by token: the engine's outputs plus the observation; the mask covers exactly the engine's tokens
    assert ep.token_ids == s1.token_ids + obs + s2.token_ids
    assert ep.logprobs == s1.logprobs + [0.0] * len(obs) + s2.logprobs
    assert ep.loss_mask == [1] * len(s1.token_ids) + [0] * len(obs) + [1] * len(s2.token_ids)
    assert ep.turn_starts == [0, len(s1.token_ids) + len(obs)]
    # the weight update between the turns shows in the spans, at turn 2's first token
    assert (s1.version_span_versions, s2.version_span_versions) == ([v], [v + 1])
    assert (ep.version_span_starts, ep.version_span_versions) == ([0, len(s1.token_ids) + len(obs)], [v, v + 1])
    rows = runner.rows([ep], prompt_index=0, attempt=0, task="vf", rollout_id="r", timeline=0)
    assert rows[0].reward_fn_version.startswith("verifiers:gyre_vf_two_turn@")
    assert (rows[0].reward, rows[0].reward_error, rows[0].loss_mask) == (1.0, "", ep.loss_mask)
    assert from_table(to_table(rows)) == rows  # the stored trajectory is the episode, exactly


def test_a_group_plays_its_prompt_index_task_and_a_full_context_ends_it(running, taskset, tiny_llama):
    runner, tok = runner_for(tiny_llama)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
    try:  # task 1 ("red", "blue"); a context of 40 tokens leaves turn 2 no room
        short = running.run(runner.run_group(running.engine, None, 2, sampling, "g-1", 40, seed=3,
                                             fallback_prompt=[1], prompt_index=1))
        full = running.run(runner.run_group(running.engine, None, 2, sampling, "g-2", 1024, seed=3,
                                            fallback_prompt=[1], prompt_index=3))
    finally:
        running.run(runner.close())
    assert "red" in tok.decode(short[0].prompt_token_ids) and "hello" not in tok.decode(short[0].prompt_token_ids)
    assert short[0].prompt_token_ids == short[1].prompt_token_ids == full[0].prompt_token_ids  # 3 % 2 == 1
    for ep in short:  # turn 2 would pass max_model_len: the episode ends there, truncated (verifiers' rule)
        assert (ep.error, ep.episode_end, ep.finish_reason, ep.reward, ep.turn_starts) == (
            "", "max_tokens", "length", 0.0, [0])
        assert ep.loss_mask == [1] * len(ep.token_ids) and len(ep.token_ids) == 12
    rows = runner.rows(short, prompt_index=1, attempt=0, task="vf", rollout_id="r", timeline=0)
    assert [(r.reward, r.reward_error, r.episode_end) for r in rows] == [(0.0, "", "max_tokens")] * 2
    assert [e.error for e in full] == ["", ""] and [len(e.turn_starts) for e in full] == [2, 2]
    assert full[0].token_ids != full[1].token_ids  # seeds differ per episode


def test_the_worker_streams_verifiers_episode_groups_into_replay(running, taskset, tiny_llama):
    from transformers import AutoTokenizer

    from gyre.proto.trajectory import from_table
    from gyre.replay.buffer import TrajectoryBuffer
    from gyre.replay.config import ReplayConfig
    from gyre.rollout.config import RolloutConfig
    from gyre.rollout.agents.environment import VerifiersConfig
    from gyre.rollout.agents.verifiers_env import VerifiersRunner
    from gyre.rollout.worker import RolloutWorker
    from tests.fakes import FakeReplay, until
    from tests.unit.rollout.test_rollout_worker import TASK

    buf = TrajectoryBuffer(ReplayConfig())
    config = RolloutConfig.model_construct(
        engine=engine_config(tiny_llama), sampling=SamplingConfig(temperature=1.0, max_new_tokens=8), group_size=2,
        groups_in_flight=2, max_ready_groups=2, retry_backoff_s=0.01, num_workers=1,
        verifiers=VerifiersConfig(taskset="gyre_vf_two_turn", heldout=1))
    worker = RolloutWorker("r0", config, TASK, running.engine, FakeReplay(buf),
                           AutoTokenizer.from_pretrained(tiny_llama), seed=3)
    assert isinstance(worker.episodes, VerifiersRunner)

    async def go():
        task = asyncio.create_task(worker.run())
        await until(lambda: task.done() or buf.info()["size_groups"] >= 2, "two verifiers groups in replay",
                    timeout_s=240)
        worker.stop()
        await task

    running.run(go())
    assert worker.episodes.endpoint is None  # run() closed verifiers' servers and the endpoint
    _, table = buf.sample(2, learner_version=0)
    rows = from_table(table)
    assert all(r.reward_fn_version.startswith("verifiers:gyre_vf_two_turn@") for r in rows)
    assert all(len(r.turn_starts) == 2 and 0 in r.loss_mask and r.reward_error == "" for r in rows), rows
    stats = worker.stats.as_dict(0)["episodes"]
    assert stats["episodes"] >= 4 and stats["turns"] == 2 * stats["episodes"] and stats.get("broken", 0) == 0
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert all("hello" in tok.decode(r.prompt_token_ids) for r in rows)  # only task 0 is trained on
    # held-out evaluation plays the held-out task (1: "red", "blue") once greedily, and 2 sampled episodes
    from gyre.rollout.evaluation import EvalConfig

    result = running.run(worker.evaluate(EvalConfig(n_samples=2, max_new_tokens=6)))
    m = result.metrics
    assert (m["heldout_size"], m["heldout_turns_mean"], m["heldout_broken"]) == (1, 2.0, 0), m
    assert m["heldout_accuracy"] == 1.0 and m["heldout_pass@2"] == 1.0  # the task rewards two replies
    greedy = [r for r in result.completions if r["greedy"]]
    assert len(result.completions) == 3 and greedy[0]["set"] == "gyre_vf_two_turn"
    assert [m["content"] for m in greedy[0]["transcript"] if m["role"] == "user"] == ["red", "blue"]
