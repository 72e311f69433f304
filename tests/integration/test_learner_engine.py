"""LearnerEngine on the tiny random Llama: real DeepSpeed (gloo, CPU), ZeRO-2.

The first DeepSpeed init in a fresh ``TORCH_EXTENSIONS_DIR`` JIT-builds the shm comm op (~30-90 s).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from gyre.learner.batch import build_train_batch
from gyre.learner.checkpoint.request import CheckpointRequest
from gyre.learner.checkpoint.store import CheckpointError
from gyre.learner.config import AlgorithmConfig, LearnerConfig
from gyre.learner.engine import LearnerEngine
from gyre.proto.trajectory import Trajectory, make_ids, to_table

ALGO = AlgorithmConfig()


def _table(num_groups: int = 2, group_size: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for g in range(num_groups):
        prompt = torch.randint(1, 49000, (5 + g,), generator=gen).tolist()
        for s in range(group_size):
            response = torch.randint(1, 49000, (3 + 2 * s,), generator=gen).tolist()
            tid, gid = make_ids(g, s, 0)
            rows.append(
                Trajectory(
                    trajectory_id=tid, group_id=gid, prompt_index=g, sample_index=s, attempt=0, task="t",
                    prompt_token_ids=prompt, response_token_ids=response,
                    # random tokens under a random model: logprob ~ -ln(49152) ~ -10.8
                    behaviour_logprobs=(-10.8 + 0.3 * torch.randn(len(response), generator=gen)).tolist(),
                    reward=float(s == g % group_size), finish_reason="stop",
                    version_span_starts=[0], version_span_versions=[0],
                    reward_fn_version="v", rollout_id="r", created_at=0.0,
                )
            )
    return to_table(rows)


def _engine(model_dir, **overrides) -> LearnerEngine:
    cfg = dict(model=str(model_dir), zero_stage=2, dtype="bf16", micro_batch_size=2, lr=1e-3)
    return LearnerEngine(LearnerConfig(**(cfg | overrides)), ALGO)


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory):
    """An engine after two ZeRO-2 bf16 steps, the initial weights and the step metrics."""
    engine = _engine(tiny_llama)
    initial = dict(engine.named_weights())
    metrics = [
        engine.train_step(build_train_batch(_table(seed=i), 0, engine.version, ALGO)) for i in range(2)
    ]
    return engine, initial, metrics


def test_two_steps_change_weights_with_finite_metrics(trained):
    engine, initial, metrics = trained
    assert engine.step == engine.version == 2
    for m in metrics:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
        assert m["tokens"] > m["response_tokens"] > 0 and m["tokens_per_s"] > 0
        assert m["staleness_max"] == float(metrics.index(m))  # spans at version 0, learner at 0 then 1
    after = dict(engine.named_weights())
    changed = [n for n in initial if not torch.equal(initial[n], after[n])]
    assert len(changed) > len(initial) // 2, f"only {changed} changed"


def test_named_weights_match_hf_state_dict(trained, tiny_llama):
    engine, _, _ = trained
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    expected = {k: v.shape for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    weights = engine.named_weights()
    assert engine.tied_lm_head
    assert {n: t.shape for n, t in weights} == expected
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() for _, t in weights)


def test_captured_weights_are_private_copies_equal_to_the_published_weights(trained):
    """What a step's publish captures (``capture_weights``) is what ``named_weights`` gives, on the parameters'
    device, and an optimizer step after the capture does not reach it (the background publish reads it later)."""
    engine, _, _ = trained
    captured = engine.capture_weights()
    expected = engine.named_weights()
    assert [n for n, _ in captured] == [n for n, _ in expected]
    assert all(torch.equal(c, e) and c.dtype == torch.bfloat16 for (_, c), (_, e) in zip(captured, expected))
    param = dict(engine.module.named_parameters())[captured[0][0]]
    kept = param.detach().clone()
    with torch.no_grad():
        param.add_(1.0)
    try:
        assert torch.equal(captured[0][1], expected[0][1])
    finally:
        with torch.no_grad():
            param.copy_(kept)


def test_export_hf_reloads_with_same_logits(trained, tiny_llama, tmp_path):
    engine, _, _ = trained
    engine.export_hf(tmp_path / "hf", tokenizer_dir=str(tiny_llama))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    ids = torch.randint(1, 49000, (2, 12), generator=torch.Generator().manual_seed(5))
    engine.module.eval()
    with torch.no_grad():
        expected = engine.module(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_checkpoint_roundtrip_restores_weights_and_version(trained, tmp_path):
    engine, _, _ = trained
    path = engine.save_checkpoint(CheckpointRequest(tmp_path / "ckpt", pending_lease_ids=["a"], fingerprint="fp"))
    assert path == tmp_path / "ckpt" / "global_step_2" and (path / "manifest.json").is_file()
    saved = dict(engine.named_weights())
    engine.train_step(build_train_batch(_table(seed=9), 0, engine.version, ALGO))
    assert engine.version == 3
    meta = engine.load_checkpoint(path, fingerprint="fp")
    assert meta.pending_lease_ids == ["a"] and engine.step == engine.version == 2
    assert all(torch.equal(saved[n], t) for n, t in engine.named_weights())
    with pytest.raises(CheckpointError, match="fingerprint: checkpoint 'fp' != current 'other'"):
        engine.load_checkpoint(path, fingerprint="other")
    (path / "metadata.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"checkpoint {path}: metadata.json has 2 bytes"):
        engine.load_checkpoint(path, fingerprint="fp")


def test_gyre_export_of_a_checkpoint_has_the_engines_logits(trained, tmp_path, capsys):
    from gyre.services.cli import main as cli

    engine, _, _ = trained
    path = engine.save_checkpoint(CheckpointRequest(tmp_path / "ckpt"))
    assert cli.main(["export", str(path), str(tmp_path / "hf")]) == 0
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    ids = torch.randint(1, 49000, (2, 12), generator=torch.Generator().manual_seed(6))
    engine.module.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, engine.module(input_ids=ids).logits,
                                   atol=0, rtol=0)
    (path / "learner_config.json").write_text("{}")
    assert cli.main(["export", str(path), str(tmp_path / "hf2")]) == 2
    assert "learner_config.json has 2 bytes" in capsys.readouterr().out


def test_micro_batching_gives_the_full_batch_update(tiny_llama):
    """fp32: six rows as 6 micro-batches of 1 and as 1 micro-batch of 6 make the same update.

    ``adam_eps = 1`` makes the first AdamW step ``lr * g / (|g| + 1) ~ lr * g`` (the gradients are
    ~1e-4), i.e. SGD-like, so the weight deltas check the accumulated gradient's scale and direction
    (plain Adam's ``lr * sign(g)`` would hide a wrong scale and amplify noise on near-zero entries).
    """
    batch = build_train_batch(_table(seed=3), 0, 0, ALGO)
    initial = None
    results = []
    for mbs in (1, 6):
        engine = _engine(tiny_llama, dtype="fp32", micro_batch_size=mbs, lr=1.0, adam_eps=1.0)
        initial = dict(engine.named_weights(dtype=None))
        metrics = engine.train_step(batch)
        delta = {n: t - initial[n] for n, t in engine.named_weights(dtype=None)}
        results.append((metrics, delta))
    (m1, d1), (m6, d6) = results
    assert m1["loss"] == pytest.approx(m6["loss"], rel=1e-5)
    assert m1["grad_norm"] == pytest.approx(m6["grad_norm"], rel=1e-4)
    assert max(d.abs().max() for d in d6.values()) > 1e-4  # the step did move the weights
    for name in d1:
        torch.testing.assert_close(d1[name], d6[name], atol=1e-7, rtol=1e-3)
