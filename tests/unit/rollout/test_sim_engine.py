"""The simulated rollout engine (benchmarks): sample shapes, seeding, version spans, weight checks, pauses."""

import asyncio
import math
import time

import pytest
import torch
from pydantic import ValidationError

from gyre.rollout.config import EngineConfig, SamplingConfig, SimulatedEngineConfig
from gyre.rollout.sim_engine import SimulatedEngine, check_weights, version_spans
from gyre.proto.exports import load_export

SAMPLING = SamplingConfig(max_new_tokens=12)


def sim_config(model, **timing) -> EngineConfig:
    return EngineConfig(model=str(model), kind="simulated", max_model_len=64,
                        simulated=SimulatedEngineConfig(**({"seconds_per_group": 0.0} | timing)))


def test_version_spans_place_each_update_at_the_first_token_after_it():
    history = [(float("-inf"), 0), (10.0, 1), (12.5, 2)]
    # 10 tokens over [9, 14]: token k at 9 + 0.5 k; v1 from token 2 (t=10.0), v2 from token 7 (t=12.5).
    assert version_spans(history, 9.0, 14.0, 10) == ([0, 2, 7], [0, 1, 2])
    assert version_spans(history, 10.0, 11.0, 4) == ([0], [1])  # applied at t0: the whole group is v1
    assert version_spans(history, 13.0, 13.0, 3) == ([0], [2])  # zero-length generation
    # Two updates before the same token: the newer sampled it; an update after the last token is not seen.
    assert version_spans([(0.0, 0), (1.01, 1), (1.02, 2), (1.99, 3)], 1.0, 2.0, 2) == ([0, 1], [0, 2])


def test_version_spans_refuse_bad_input():
    with pytest.raises(ValueError, match=r"num_tokens \(0\)"):
        version_spans([(0.0, 0)], 1.0, 2.0, 0)
    with pytest.raises(ValueError, match=r"no policy version was applied by t0 \(1.0\)"):
        version_spans([(5.0, 0)], 1.0, 2.0, 3)


def test_check_weights_names_the_bad_tensor():
    expected = {"a": (2, 3), "b": (4,), "lm_head": (2, 3)}
    good = [("a", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(4))]
    assert check_weights(good, expected, {"lm_head"}, "m") == 2 * 3 * 2 + 4 * 4
    with pytest.raises(ValueError, match="unknown tensor 'c'"):
        check_weights(good + [("c", torch.zeros(1))], expected, {"lm_head"}, "m")
    with pytest.raises(ValueError, match=r"tensor 'b' has shape \(5,\)"):
        check_weights([good[0], ("b", torch.zeros(5))], expected, {"lm_head"}, "m")
    with pytest.raises(ValueError, match=r"tensor 'b' has shape \(4,\) and dtype torch.int64"):
        check_weights([good[0], ("b", torch.zeros(4, dtype=torch.long))], expected, {"lm_head"}, "m")
    with pytest.raises(ValueError, match="'a' appears more than once"):
        check_weights(good + [good[0]], expected, {"lm_head"}, "m")
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\), e.g. \['b'\]"):
        check_weights(good[:1], expected, {"lm_head"}, "m")


def test_engine_config_kind_and_simulated_section_must_agree(tiny_llama):
    with pytest.raises(ValidationError, match="kind 'simulated' needs a simulated section"):
        EngineConfig(model=str(tiny_llama), kind="simulated")
    with pytest.raises(ValidationError, match="kind 'simulated' needs a simulated section"):
        EngineConfig(model=str(tiny_llama), simulated={"seconds_per_group": 1.0})
    with pytest.raises(ValidationError, match="exactly one of seconds_per_group"):
        SimulatedEngineConfig(seconds_per_group=1.0, seconds_per_token=0.1)
    with pytest.raises(ValidationError, match="exactly one of seconds_per_group"):
        SimulatedEngineConfig()
    assert EngineConfig(model=str(tiny_llama)).kind == "vllm"


def test_generate_returns_a_group_of_full_length_random_samples(tiny_llama):
    async def scenario():
        engine = await SimulatedEngine.start(sim_config(tiny_llama))
        a = await engine.generate([1, 2, 3], 3, SAMPLING, "r1", seed=7)
        b = await engine.generate([1, 2, 3], 3, SAMPLING, "r2", seed=7)
        c = await engine.generate([1, 2, 3], 3, SAMPLING, "r3", seed=8)
        return engine, a, b, c

    engine, a, b, c = asyncio.run(scenario())
    vocab = len(engine._tokenizer)
    assert len(a) == 3
    for s in a:
        assert len(s.token_ids) == len(s.logprobs) == 12 and s.finish_reason == "length"
        assert all(isinstance(t, int) and 0 <= t < vocab for t in s.token_ids)
        assert all(isinstance(x, float) and x < 0 and abs(x + math.log(vocab)) < 1.0 for x in s.logprobs)
        assert (s.version_span_starts, s.version_span_versions) == ([0], [0])
    assert [s.token_ids for s in a] == [s.token_ids for s in b]  # same seed, same group
    assert [s.token_ids for s in a] != [s.token_ids for s in c]
    assert a[0].token_ids != a[1].token_ids  # samples of a group differ


def test_generate_refuses_what_the_real_engine_refuses(tiny_llama):
    engine = asyncio.run(SimulatedEngine.start(sim_config(tiny_llama)))
    with pytest.raises(ValueError, match=r"prompt \+ max_new_tokens \(72\) <= max_model_len \(64\)"):
        asyncio.run(engine.generate([1] * 60, 2, SAMPLING, "r"))
    with pytest.raises(ValueError, match=r"n \(0\) >= 1"):
        asyncio.run(engine.generate([1], 0, SAMPLING, "r"))


def test_seconds_per_token_times_the_group(tiny_llama):
    engine = asyncio.run(SimulatedEngine.start(sim_config(tiny_llama, seconds_per_group=None,
                                                          seconds_per_token=0.01)))
    assert engine.group_seconds(4, 12) == pytest.approx(0.48)


def test_a_weight_update_mid_group_pauses_it_and_opens_a_span(tiny_llama):
    """The update lands mid-group (the group is running when it starts) and pauses the group: the pause (0.6 s)
    outlasts the group's remaining 0.4 s, so an unpaused group would be done when the update returns; a
    paused one still owes 0.4 s of generation then."""
    weights = load_export(tiny_llama)

    async def scenario():
        engine = await SimulatedEngine.start(sim_config(tiny_llama, seconds_per_group=0.6, apply_s=0.6))
        t0 = time.monotonic()
        group = asyncio.create_task(engine.generate([1, 2], 2, SAMPLING, "r", seed=1))
        await asyncio.sleep(0.2)
        running_at_update = not group.done()
        await engine.update_weights(1, weights)
        running_after_update = not group.done()
        samples = await group
        return engine, samples, (running_at_update, running_after_update), time.monotonic() - t0

    engine, samples, running, elapsed = asyncio.run(scenario())
    assert running == (True, True), "the group finished during the update: it was not paused"
    assert engine.version == 1 and engine.applied_bytes == sum(t.numel() * t.element_size() for _, t in weights)
    for s in samples:
        assert s.version_span_versions == [0, 1]
        assert 0 < s.version_span_starts[1] < 12
    assert elapsed >= 0.6 + 0.6  # the pause did not count as generation time


def test_update_weights_refuses_stale_versions_wrong_tensors_and_manifests(tiny_llama):
    weights = load_export(tiny_llama)
    engine = asyncio.run(SimulatedEngine.start(sim_config(tiny_llama)))
    asyncio.run(engine.update_weights(2, weights))
    with pytest.raises(ValueError, match=r"weight version \(2\) must be newer than the current one \(2\)"):
        asyncio.run(engine.update_weights(2, weights))
    with pytest.raises(ValueError, match="unknown tensor 'nope'"):
        asyncio.run(engine.update_weights(3, weights + [("nope", torch.zeros(1))]))
    with pytest.raises(ValueError, match="takes named tensors .gRPC transport., got object"):
        asyncio.run(engine.update_weights(3, object()))
    assert engine.version == 2
