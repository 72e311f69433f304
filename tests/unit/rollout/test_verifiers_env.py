"""The verifiers adapter's parts without vLLM: the generate endpoint (against a scripted engine, parsed by the
``renderers`` client's own response parser), trajectory assembly, the bridge renderer, and config errors.
The whole path with real vLLM and a verifiers environment is tests/integration/test_verifiers_env.py."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from types import SimpleNamespace

import aiohttp
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from gyre.rollout.config import RolloutConfig, SamplingConfig
from gyre.rollout.agents.environment import VerifiersConfig
from gyre.rollout.agents.episode import TurnRenderer
from gyre.rollout.agents.generate_endpoint import Call, GenerateEndpoint
from gyre.rollout.types import Sample

pytest.importorskip("verifiers.v1")

from gyre.rollout.agents.verifiers_env import (  # noqa: E402 - after the skip
    LOCAL_AGENT, VerifiersLoadError, VerifiersRunner, assemble, env_config, episode_end, score)

SAMPLING = SamplingConfig(temperature=0.7, max_new_tokens=8)


def sample(ids, version=0, finish="stop"):
    return Sample(token_ids=list(ids), logprobs=[-0.25] * len(ids), finish_reason=finish,
                  version_span_starts=[0], version_span_versions=[version], text="x")


class ScriptEngine:
    """Answers every request with ids 100.. (``n`` of them); records (prompt, sampling, seed); fails on demand."""

    def __init__(self, n=3, fail=False):
        self.n, self.fail, self.requests, self.version = n, fail, [], 5

    async def generate(self, prompt_token_ids, n, sampling, request_id, seed=None):
        if self.fail:
            raise RuntimeError("engine core died")
        self.requests.append((list(prompt_token_ids), sampling, seed))
        return [sample(range(100, 100 + min(self.n, sampling.max_new_tokens)), version=self.version)]


async def post(session, url, body):
    async with session.post(url.removesuffix("/v1") + "/inference/v1/generate", json=body) as r:
        return r.status, await r.read()


def serve(engine, check, max_model_len=64, seed=11):
    async def main():
        endpoint = GenerateEndpoint(vocab_size=1000, model_name="m")
        await endpoint.start()
        key, url = endpoint.open(engine, SAMPLING, max_model_len, seed=seed)
        try:
            async with aiohttp.ClientSession() as session:
                return await check(endpoint, key, url, session)
        finally:
            await endpoint.close()
    return asyncio.run(main())


def test_the_endpoint_speaks_the_renderers_wire_and_records_each_call():
    from renderers.client import _parse_completion_logprobs, parse_generate_response

    engine = ScriptEngine()

    async def check(endpoint, key, url, session):
        status, raw = await post(session, url, {"model": "m", "token_ids": [1, 2, 3],
                                                "sampling_params": {"max_tokens": 2, "temperature": 1.5}})
        assert status == 200
        data = parse_generate_response(raw)
        choice = data["choices"][0]
        assert choice["token_ids"] == [100, 101] and data["prompt_token_ids"] == [1, 2, 3]
        assert _parse_completion_logprobs(choice, choice["token_ids"]) == [-0.25, -0.25]
        status, _ = await post(session, url, {"model": "m", "token_ids": [1, 2, 3, 100, 101, 7]})
        async with session.get(f"{url}/models") as r:
            card = (await r.json())["data"][0]
        return status, card, endpoint.close_episode(key)

    status, card, (calls, refused) = serve(engine, check)
    assert status == 200 and (card["id"], card["max_model_len"]) == ("m", 64) and refused == []
    assert [c.prompt_token_ids for c in calls] == [[1, 2, 3], [1, 2, 3, 100, 101, 7]]
    # the recipe's temperature whatever the request asks; the request's max_tokens within the recipe's budget;
    # call k seeded seed + k
    (_, s0, seed0), (_, s1, seed1) = engine.requests
    assert (s0.temperature, s0.max_new_tokens, seed0) == (0.7, 2, 11)
    assert (s1.temperature, s1.max_new_tokens, seed1) == (0.7, 8, 12)


@pytest.mark.parametrize("body, status, words", [
    ({"token_ids": []}, 400, "token_ids is []"),
    ({"token_ids": [1, "a"]}, 400, "token_ids[1] is 'a'"),
    ({"token_ids": [1, 1000]}, 400, "token_ids[1] is 1000; expected an int in [0, 1000)"),
    ({"token_ids": [1, True]}, 400, "token_ids[1] is True"),
    ({"token_ids": [1], "sampling_params": [1]}, 400, "sampling_params is [1]"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, 400, "max_tokens is 0"),
    ({"token_ids": list(range(64))}, 400, "the prompt has 64 tokens; the engine's max_model_len is 64"),
    ([1, 2], 400, "request body is list"),
])
def test_bad_requests_get_a_4xx_naming_the_value_and_never_reach_the_engine(body, status, words):
    engine = ScriptEngine()

    async def check(endpoint, key, url, session):
        got, raw = await post(session, url, body)
        return got, raw.decode(), endpoint.close_episode(key)

    got, text, (calls, refused) = serve(engine, check)
    assert got == status and words in text and engine.requests == [] and calls == []
    assert len(refused) == 1 and words in refused[0]


def test_unknown_episode_is_404_and_an_engine_failure_is_raised_at_close():
    async def check(endpoint, key, url, session):
        other = url.replace(key, "nope")
        missing, _ = await post(session, other, {"token_ids": [1]})
        failed, raw = await post(session, url, {"token_ids": [1]})
        with pytest.raises(RuntimeError, match="engine core died"):
            endpoint.close_episode(key)
        return missing, failed, raw.decode()

    missing, failed, text = serve(ScriptEngine(fail=True), check)
    assert (missing, failed) == (404, 500) and "engine core died" in text


def test_assemble_appends_each_calls_extension_as_observation_and_its_sample_as_a_turn():
    calls = [Call([1, 2], sample([10, 11], version=3, finish="length")),
             Call([1, 2, 10, 11, 2, 7, 8], sample([12], version=4))]
    ep = assemble(calls, version=3)
    assert (ep.error, ep.prompt_token_ids, ep.token_ids) == ("", [1, 2], [10, 11, 2, 7, 8, 12])
    assert ep.loss_mask == [1, 1, 0, 0, 0, 1] and ep.logprobs == [-0.25, -0.25, 0.0, 0.0, 0.0, -0.25]
    assert (ep.turn_starts, ep.version_span_starts, ep.version_span_versions) == ([0, 5], [0, 5], [3, 4])
    assert ep.finish_reason == "stop"


def test_a_call_that_does_not_extend_the_context_breaks_the_episode_and_keeps_the_turns_before():
    calls = [Call([1, 2], sample([10, 11])), Call([1, 2, 10, 99, 7], sample([12]))]
    ep = assemble(calls, version=0)
    assert ep.error.startswith("episode-verifiers_retokenized: call 1's prompt (5 tokens) does not extend the "
                               "episode's context (4 tokens), first difference at token 3")
    assert (ep.token_ids, ep.loss_mask, ep.turn_starts) == ([10, 11], [1, 1], [0])
    empty = assemble([], version=7)
    assert empty.error == "episode-verifiers_error: the environment made no model call"
    assert (empty.turn_starts, empty.version_span_versions) == ([0], [7])


def trace(reward=1.0, stop="user_closed", calls=(), errors=(), tool_calls=0):
    msg = SimpleNamespace(role="assistant", content="hi", tool_calls=[object()] * tool_calls)
    return SimpleNamespace(reward=reward, stop_condition=stop, calls=list(calls), errors=list(errors),
                           assistant_messages=[msg], messages=[msg])


def test_score_takes_the_traces_reward_and_breaks_on_failures():
    ok = SimpleNamespace(traces=[trace(tool_calls=2)], ok=True, last_error=None)
    ep = score(assemble([Call([1], sample([5]))], 0), ok, [])
    assert (ep.error, ep.reward, ep.tool_calls, ep.episode_end) == ("", 1.0, 2, "done")
    failed = SimpleNamespace(traces=[trace()], ok=False, last_error=SimpleNamespace(type="HarnessError",
                                                                                   message="exited 1"))
    assert score(assemble([Call([1], sample([5]))], 0), failed, []).error == \
        "episode-verifiers_error: HarnessError: exited 1"
    refused = score(assemble([Call([1], sample([5]))], 0), ok, ["token_ids[0] is -1"])
    assert refused.error == "episode-verifiers_error: gyre refused a generate request: token_ids[0] is -1"
    no_call = score(assemble([], 0), failed, [])  # the harness died before its first call: verifiers says why
    assert no_call.error == "episode-verifiers_error: HarnessError: exited 1"
    two = SimpleNamespace(traces=[trace(), trace()], ok=True, last_error=None)
    assert "holds 2 traces" in score(assemble([Call([1], sample([5]))], 0), two, []).error


def test_episode_end_maps_verifiers_stops():
    overflow = SimpleNamespace(error=SimpleNamespace(message="Prompt length (43) exceeds maximum context length (40)."))
    assert episode_end(trace(stop="max_turns")) == "max_turns"
    assert episode_end(trace(stop="max_total_tokens")) == "max_tokens"
    assert episode_end(trace(calls=[overflow])) == "max_tokens"
    assert episode_end(trace()) == "done"


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_bridge_renderer_appends_the_templates_rendering_of_new_messages(tok):
    from renderers.configs import DefaultRendererConfig

    from gyre.rollout.agents.verifiers_renderer import TemplateBridgeRenderer

    r = TemplateBridgeRenderer(tok, DefaultRendererConfig())
    prompt = r.render_ids([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    turns = TurnRenderer(tok)
    for completion, closed in (([300, 301, 2], True), ([300, 301], False)):  # a closed turn, a cut one
        new = [{"role": "tool", "content": "42"}, {"role": "user", "content": "go on"}]
        out = r.bridge_to_next_turn(prompt, completion, new)
        ext = turns.observation_ids(new, closed)
        assert out.token_ids == prompt + completion + ext
        assert out.sampled_mask == [False] * len(out.token_ids) and out.message_roles == ["tool", "user"]
        owned = out.message_indices[len(prompt) + len(completion):]
        by = {k: tok.decode([t for t, i in zip(ext, owned) if i == k]) for k in (-1, 0, 1)}
        assert by[0] == "<|im_start|>tool\n42<|im_end|>\n" and by[1] == "<|im_start|>user\ngo on<|im_end|>\n"
        assert by[-1] == ("\n" if closed else "<|im_end|>\n") + "<|im_start|>assistant\n"  # the scaffold
        assert out.message_indices[:len(prompt) + len(completion)] == [-1] * (len(prompt) + len(completion))
    assert r.bridge_to_next_turn(prompt, [300], [{"role": "assistant", "content": "x"}]) is None
    assert r.bridge_to_next_turn(prompt, [300], [{"role": "user", "content": [{"type": "text"}]}]) is None


def test_observation_text_spans_cover_each_message(tok):
    turns = TurnRenderer(tok)
    obs = [{"role": "tool", "content": "42"}, {"role": "user", "content": "ok"}]
    text, spans = turns.observation_text(obs, True), turns.message_spans(obs, True)
    assert tok.encode(text, add_special_tokens=False) == turns.observation_ids(
        [{"role": "tool", "content": "42"}, {"role": "user", "content": "ok"}], True)
    assert "42" in text[slice(*spans[0])] and "ok" in text[slice(*spans[1])] and spans[0][1] == spans[1][0]


TASKSET = textwrap.dedent('''
    import verifiers.v1 as vf

    class T(vf.Task[vf.TaskData]):
        pass

    class TS(vf.Taskset[T, vf.TasksetConfig]):
        def load(self):
            return [T(vf.TaskData(idx=i, prompt=f"p{i}"), self.config.task) for i in range(3)]

    __all__ = ["TS"]
''')


@pytest.fixture
def taskset(tmp_path, monkeypatch):
    (tmp_path / "gyre_vf_unit_taskset.py").write_text(TASKSET)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "gyre_vf_unit_taskset"


def test_env_config_gives_unset_roles_a_local_null_agent_and_keeps_set_ones(taskset):
    cfg = env_config(VerifiersConfig(taskset=taskset))
    assert (cfg.taskset.id, cfg.agent.harness.id, cfg.agent.runtime.type) == (
        taskset, LOCAL_AGENT["harness"]["id"], "subprocess")
    cfg = env_config(VerifiersConfig(taskset=taskset, env={"agent": {"runtime": {"type": "docker"}}}))
    assert (cfg.agent.harness.id, cfg.agent.runtime.type) == ("null", "docker")


def test_a_local_harness_that_aborts_leaves_its_python_stacks_in_stderr(taskset):
    """An abort() inside the harness program (C code, glibc, a Rust extension) prints nothing by itself, so
    verifiers' ``harness 'null' exited -6: <stderr tail>`` read ``<no output>``; the local agent's harness env
    turns on faulthandler, which writes every thread's Python stack before the process dies of the signal."""
    import subprocess

    cfg = env_config(VerifiersConfig(taskset=taskset))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"} | cfg.agent.harness.resolved_env
    program = "import os\ndef deep():\n    os.abort()\ndeep()\n"
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == -6
    assert "Fatal Python error: Aborted" in out.stderr and 'line 3 in deep' in out.stderr, out.stderr


def test_runner_loads_the_tasks_holds_out_the_last_ones_and_names_its_version(taskset, tok, tiny_llama):
    runner = VerifiersRunner(VerifiersConfig(taskset=taskset), str(tiny_llama), tok)
    assert [t.data.prompt for t in runner.tasks] == ["p0", "p1", "p2"] and runner.train_count == 3
    assert runner.version.startswith(f"verifiers:{taskset}@") and runner.renderer.name == "custom"
    assert runner.task_reward is False and runner.heldout() == []
    held = VerifiersRunner(VerifiersConfig(taskset=taskset, heldout=1), str(tiny_llama), tok)
    assert held.train_count == 2 and [(p.task, p.question, p.index) for p in held.heldout()] == [(taskset, "p2", 2)]
    with pytest.raises(VerifiersLoadError, match="has 3 tasks; expected more than rollout.verifiers.heldout \\(3\\)"):
        VerifiersRunner(VerifiersConfig(taskset=taskset, heldout=3), str(tiny_llama), tok)


@pytest.mark.parametrize("config, words", [
    (dict(taskset="gyre_no_such_taskset"), "gyre_no_such_taskset"),
    (dict(taskset="TASKSET", env={"taskset": {"id": "other"}}), "expected a mapping whose id"),
    (dict(taskset="TASKSET", env={"agent": {"harness": {"id": "no-such-harness"}}}), "no-such-harness"),
    (dict(taskset="TASKSET", renderer={"name": "no-such-renderer"}), "rollout.verifiers.renderer"),
])
def test_bad_verifiers_configs_name_the_bad_value(config, words, taskset, tok, tiny_llama):
    config = {k: (taskset if v == "TASKSET" else v) for k, v in config.items()}
    with pytest.raises(VerifiersLoadError, match=words.replace("(", r"\(")):
        VerifiersRunner(VerifiersConfig(**config), str(tiny_llama), tok)


def test_recipe_sets_at_most_one_episode_source(tiny_llama):
    base = {"engine": {"model": str(tiny_llama)}, "verifiers": {"taskset": "t"},
            "environment": {"factory": "gyre.rollout.agents.tools:ToolEnvironment"}}
    with pytest.raises(ValidationError, match="rollout.environment and rollout.verifiers are both set"):
        RolloutConfig.model_validate(base)
    with pytest.raises(ValidationError, match="rollout.verifiers.taskset is empty"):
        VerifiersConfig(taskset=" ")
    assert RolloutConfig.model_validate({**base, "environment": None}).verifiers.taskset == "t"


def test_a_verifiers_recipe_needs_held_out_tasks_to_evaluate():
    from gyre.services.control.recipe.schema import RecipeError, load_recipe

    vf = {"rollout.verifiers": {"taskset": "t"}}
    with pytest.raises(RecipeError, match="rollout.verifiers.heldout is 0, so there is no held-out task"):
        load_recipe("deploy/recipes/smollm2-arith.yaml", vf, dry_run=True)
    with pytest.raises(RecipeError, match="eval.sets .* must be unset with rollout.verifiers"):
        load_recipe("deploy/recipes/smollm2-arith.yaml", {"rollout.verifiers": {"taskset": "t", "heldout": 2},
                                                          "eval.sets": ["arithmetic"]}, dry_run=True)
    off = load_recipe("deploy/recipes/smollm2-arith.yaml", {**vf, "eval.before": False, "eval.after": False},
                      dry_run=True)
    assert off.rollout.verifiers.taskset == "t"


def test_verifiers_is_imported_only_by_recipes_that_use_it():
    assert "gyre.rollout.agents.verifiers_env" in sys.modules  # this test module imported it; a plain worker does not:
    import subprocess

    out = subprocess.run([sys.executable, "-c", "import rollout.worker, sys; print('verifiers' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_verifiers_example_recipe_loads_and_its_taskset_scores_retries(tok, tiny_llama):
    from pathlib import Path

    from gyre.services.control.recipe.schema import load_recipe

    repo = Path(__file__).resolve().parents[3]
    recipe = load_recipe(repo / "examples/verifiers/recipe.yaml", dry_run=True)
    vf = recipe.rollout.verifiers
    assert vf.taskset == str(repo / "examples/verifiers/arith_retry.py") and vf.taskset_id == "arith_retry"
    runner = VerifiersRunner(vf, str(tiny_llama), tok)
    assert (len(runner.tasks), runner.train_count, len(runner.heldout())) == (576, 512, 64)
    task = runner.tasks[0]
    answer = task.data.answer

    def replies(*texts):
        return SimpleNamespace(assistant_messages=[SimpleNamespace(content=t) for t in texts])

    scored = [asyncio.run(task.correct(replies(*r))) for r in (
        [f"{answer}"], [f"It is {answer - 1}", f"Sorry, {answer}"], [f"{answer + 1}", "no idea"], [])]
    assert scored == [1.0, 0.5, 0.0, 0.0]


def test_at_most_max_concurrent_episodes_run_and_waiting_is_not_in_the_time_budget(taskset, tok, tiny_llama):
    import contextlib

    runner = VerifiersRunner(VerifiersConfig(taskset=taskset, max_concurrent=2, time_budget_s=0.5),
                             str(tiny_llama), tok)
    live, peak = [0], [0]

    class Env:  # verifiers' Env as the runner uses it; plays 0.3 s and calls no model
        @contextlib.asynccontextmanager
        async def serving(self):
            yield

        async def run_episode(self, task, ctx):
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            await asyncio.sleep(0.3)
            live[0] -= 1
            return SimpleNamespace(traces=[trace()], ok=True, last_error=None)

    runner.env = Env()

    async def go():
        try:
            return await runner.run_group(ScriptEngine(), None, 6, SAMPLING, "g", 64, 0, [1], prompt_index=0)
        finally:
            await runner.close()

    episodes = asyncio.run(go())
    assert peak[0] == 2  # 6 episodes of 0.3 s, two at a time: 0.9 s in all, each within its 0.5 s budget
    assert [e.error for e in episodes] == ["episode-verifiers_error: the environment made no model call"] * 6
