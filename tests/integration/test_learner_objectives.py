"""Custom objectives (``learner.objectives``) in a real ``LearnerEngine`` step on the tiny random Llama (DeepSpeed on
CPU/gloo): a custom advantage and loss that copy the built-ins train bit-identical parameters to them (so the
engine really calls the custom path, and calls it as the built-ins are called: two mini-batches, micro-batch
accumulation, the proximal pass), and the example objectives (``examples/objectives``) train different ones."""

from __future__ import annotations

import math

import torch

from gyre.learner.batch import build_train_batch
from gyre.learner.config import AlgorithmConfig, LearnerConfig
from gyre.learner.engine import LearnerEngine
from gyre.proto.trajectory import Trajectory, make_ids, to_table

FNS = "tests.unit.learner.objective_fns"


def _table(learner_version: int = 2, seed: int = 5):
    """2 groups of 3 rows of random tokens, generated at lags 0, 1, 2 by sample index; behaviour logprobs near
    the random model's (~ -ln 49152 = -10.8)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for g in range(2):
        prompt = torch.randint(1, 49000, (4 + g,), generator=gen).tolist()
        for s in range(3):
            response = torch.randint(1, 49000, (3 + s,), generator=gen).tolist()
            tid, gid = make_ids(g, s, 0)
            rows.append(Trajectory(
                trajectory_id=tid, group_id=gid, prompt_index=g, sample_index=s, attempt=0, task="t",
                prompt_token_ids=prompt, response_token_ids=response,
                behaviour_logprobs=(-10.8 + 0.4 * torch.randn(len(response), generator=gen)).tolist(),
                reward=float((s + g) % 2) + 0.25 * s, finish_reason="stop",
                version_span_starts=[0], version_span_versions=[learner_version - s],
                reward_fn_version="v", rollout_id="r", created_at=0.0))
    return to_table(rows)


def _train(model_dir, **algo_kw) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One step (2 mini-batches of 3 rows, micro-batches of 2 + 1) from the initial weights; the parameters after."""
    algo = AlgorithmConfig(mini_batches=2, **algo_kw)
    config = LearnerConfig(model=str(model_dir), zero_stage=0, dtype="fp32", micro_batch_size=2, lr=2e-2)
    engine = LearnerEngine(config, algo)
    metrics = engine.train_step(build_train_batch(_table(), 0, 2, algo))
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}, metrics


def test_custom_objectives_are_what_the_engine_trains_with(tiny_llama):
    builtin, m_builtin = _train(tiny_llama)
    copied, m_copied = _train(tiny_llama, advantage=f"{FNS}:grpo", loss=f"{FNS}:ppo_clip")
    assert all(torch.equal(builtin[n], copied[n]) for n in builtin), "a copy of grpo + ppo_clip must train the same"
    assert m_copied["loss"] == m_builtin["loss"] and m_copied["grad_norm"] == m_builtin["grad_norm"]
    assert m_copied["custom_loss/ppo_clip_frac"] == m_builtin["ppo_clip_frac"] > 0  # the 2nd update clips
    for key in ("is_ratio_mean", "is_ratio_max", "approx_kl", "is_ess_frac"):
        assert m_copied[key] == m_builtin[key], key

    examples, m_examples = _train(tiny_llama, advantage="examples/objectives/advantages.py:batch_loo",
                                  loss="examples/objectives/losses.py:clipped_is_pg")
    changed = [n for n in builtin if not torch.equal(builtin[n], examples[n])]
    assert len(changed) > len(builtin) // 2, changed
    assert {"custom_loss/ratio_mean", "custom_loss/ratio_clip_frac"} <= m_examples.keys()
    assert "ppo_clip_frac" not in m_examples and all(math.isfinite(v) for v in m_examples.values()), m_examples
