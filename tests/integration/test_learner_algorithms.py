"""Every advantage estimator and a few off-policy corrections, with KL to a reference model (in the loss and
in the reward), for one ``train_step`` each on the tiny random Llama (real DeepSpeed ZeRO-2 bf16 on CPU/gloo);
the GAE critic trains, stays out of the published weights and goes through DeepSpeed checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

from gyre.learner.algo.advantages import group_advantages
from gyre.learner.batch import build_train_batch
from gyre.learner.checkpoint.request import CheckpointRequest
from gyre.learner.config import AlgorithmConfig, LearnerConfig
from gyre.learner.engine import LearnerEngine
from gyre.learner.step_start import eval_mode, step_targets
from gyre.proto.trajectory import Trajectory, make_ids, to_table

STEP_KEYS = {
    "loss", "grad_norm", "tokens_per_s", "is_ratio_mean", "is_ratio_max", "ppo_clip_frac", "tis_clip_frac",
    "mis_masked_frac", "approx_kl", "is_ess_frac", "entropy", "kl_to_ref",
    *(f"staleness_hist_{k}" for k in range(9)), "staleness_negative",
}
CRITIC_KEYS = {"value_loss", "value_clip_frac", "explained_variance"}


def _table(learner_version: int, seed: int, num_groups: int = 2, group_size: int = 3):
    """Groups of random tokens whose rows were generated at versions ``learner_version - lag``, lag
    0, 1, 2 by sample index; behaviour logprobs near the random model's (~ -ln 49152 = -10.8)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for g in range(num_groups):
        prompt = torch.randint(1, 49000, (4 + g,), generator=gen).tolist()
        for s in range(group_size):
            response = torch.randint(1, 49000, (3 + s,), generator=gen).tolist()
            tid, gid = make_ids(g, s, 0)
            rows.append(Trajectory(
                trajectory_id=tid, group_id=gid, prompt_index=g, sample_index=s, attempt=0, task="t",
                prompt_token_ids=prompt, response_token_ids=response,
                behaviour_logprobs=(-10.8 + 0.4 * torch.randn(len(response), generator=gen)).tolist(),
                reward=float((s + g) % 2), finish_reason="stop",
                version_span_starts=[0], version_span_versions=[max(learner_version - s, 0)],
                reward_fn_version="v", rollout_id="r", created_at=0.0,
            ))
    return to_table(rows)


def _engine(model_dir, algo: AlgorithmConfig) -> LearnerEngine:
    config = LearnerConfig(model=str(model_dir), zero_stage=2, dtype="bf16", micro_batch_size=4, lr=1e-3)
    return LearnerEngine(config, algo)


def _step_changes_weights(engine: LearnerEngine, algo: AlgorithmConfig, seed: int) -> dict[str, float]:
    before = dict(engine.named_weights())
    metrics = engine.train_step(build_train_batch(_table(engine.version, seed), 0, engine.version, algo))
    after = dict(engine.named_weights())
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(changed) > len(before) // 2, f"{algo}: only {changed} changed"
    return metrics


OUTCOME_RUNS = [
    (advantage, ratio, weight)
    for advantage in ("grpo", "dr_grpo", "rloo", "reinforce_pp")
    for ratio, weight in (("proximal", "tis_token"), ("proximal", "mis_seq"), ("behaviour", "mis_token"))
]


def test_outcome_estimators_and_corrections_with_kl(tiny_llama):
    """One engine (with its reference model); its algorithm is swapped between steps, which only
    changes how advantages and the loss are formed (the modules stay the same)."""
    base = AlgorithmConfig(kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01, max_response_tokens=8)
    engine = _engine(tiny_llama, base)
    assert engine.ref_model is not None and not engine.critic
    assert not any(p.requires_grad for p in engine.ref_model.parameters())
    for i, (advantage, ratio, weight) in enumerate(OUTCOME_RUNS):
        engine.algo = AlgorithmConfig(**(base.model_dump() | {"advantage": advantage, "policy_ratio": ratio,
                                                              "is_weight": weight}))
        m = _step_changes_weights(engine, engine.algo, seed=i)
        assert STEP_KEYS <= m.keys(), STEP_KEYS - m.keys()
        assert not CRITIC_KEYS & m.keys()
        assert all(math.isfinite(v) for v in m.values()), m
        assert 0 < m["is_ess_frac"] <= 1 and 0 <= m["mis_masked_frac"] < 1 and m["entropy"] > 0
        # lags 0, 1, 2 per group (capped at the learner's version): 2 groups x 3 rows
        lags = [min(s, engine.version - 1) for s in range(3)] * 2
        assert [m[f"staleness_hist_{k}"] for k in range(3)] == [float(lags.count(k)) for k in range(3)]
        if i == 0:  # the policy is the reference before its first update: KL exactly 0
            assert m["kl_to_ref"] == 0.0
        else:
            assert m["kl_to_ref"] > 0.0


def test_gae_critic_trains_is_unpublished_and_checkpointed(tiny_llama, tmp_path):
    algo = AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0, value_coef=1.0, kl_coef=0.05, kl_estimator="k1",
                           kl_placement="reward")
    engine = _engine(tiny_llama, algo)
    head = engine.module.value_head
    assert engine.critic and tuple(head.weight.shape) == (1, 64)
    assert not any(name.startswith("value_head") for name, _ in engine.named_weights())
    batch = build_train_batch(_table(0, seed=7), 0, 0, algo)
    assert torch.equal(batch.advantages, torch.zeros(6))  # GAE's advantages come from the engine
    before = head.weight.detach().clone()
    steps = [engine.train_step(batch) for _ in range(3)]  # same batch: lam = 1 targets are the rewards
    for m in steps:
        assert (STEP_KEYS | CRITIC_KEYS) <= m.keys() and all(math.isfinite(v) for v in m.values()), m
    assert not torch.equal(before, head.weight.detach())
    # zero-initialised head: V = 0, so explained variance starts at exactly 0 and the value loss falls
    assert steps[0]["explained_variance"] == 0.0
    assert steps[2]["value_loss"] < steps[1]["value_loss"] < steps[0]["value_loss"]
    path = engine.save_checkpoint(CheckpointRequest(tmp_path / "ckpt"))
    saved = head.weight.detach().clone()
    engine.train_step(batch)
    assert not torch.equal(saved, head.weight.detach())
    engine.load_checkpoint(path)
    assert torch.equal(saved, engine.module.value_head.weight.detach())


def test_micro_batching_keeps_every_loss_term_to_fp32_rounding(tiny_llama):
    """fp32, critic + KL + entropy + sequence TIS + Dr.GRPO's constant normaliser: six rows as six
    micro-batches of one give the loss and gradient norm of one micro-batch of six, up to the rounding
    of summing in another order (measured relative differences at most 5e-8; not bit-identical)."""
    algo = AlgorithmConfig(advantage="gae", loss_agg_mode="seq-mean-token-sum-norm", max_response_tokens=8, is_weight="tis_seq", kl_coef=0.1,
                           entropy_coef=0.01)
    batch = build_train_batch(_table(2, seed=11), 0, 2, algo)
    results = []
    for mbs in (1, 6):
        config = LearnerConfig(model=str(tiny_llama), zero_stage=0, dtype="fp32", micro_batch_size=mbs, lr=1e-3)
        results.append(LearnerEngine(config, algo).train_step(batch))
    one, six = results
    for key in ("loss", "grad_norm", "value_loss", "entropy", "is_ess_frac", "tis_clip_frac"):
        assert one[key] == pytest.approx(six[key], rel=1e-6, abs=1e-7), key


def test_kl_in_the_reward_shapes_the_outcome_advantages(tiny_llama):
    """``kl_placement: reward`` with RLOO: the step's advantages are RLOO of ``r - beta * sum_t x_t``, ``x`` from
    the policy at step start (dropout off) against the reference; 0 before the first update."""
    beta = 0.5
    algo = AlgorithmConfig(advantage="rloo", kl_coef=beta, kl_estimator="k1", kl_placement="reward")
    config = LearnerConfig(model=str(tiny_llama), zero_stage=0, dtype="fp32", micro_batch_size=8, lr=1e-3)
    engine = LearnerEngine(config, algo)  # one micro-batch: the pass below has the same shapes
    batch = build_train_batch(_table(0, seed=3), 0, 0, algo)
    start = step_targets(engine, batch)
    assert torch.equal(start.advantages, batch.advantages) and start.kl_to_ref == 0.0  # policy == reference
    first = engine.train_step(batch)
    assert first["kl_to_ref"] == 0.0
    targets = step_targets(engine, batch)
    rows = torch.arange(batch.batch_size)
    with torch.no_grad(), eval_mode(engine.engine):
        out = engine._pass(batch, rows)
        x = (out.logprobs - engine._ref_logprobs(batch, rows)).cpu()
    returns = batch.rewards - beta * torch.where(out.mask.cpu(), x, torch.zeros_like(x)).sum(dim=1)
    torch.testing.assert_close(targets.advantages, group_advantages("rloo", returns, batch.group_rows, 1e-6))
    assert targets.kl_to_ref > 0.0 and not torch.equal(targets.advantages, batch.advantages)
    assert engine.train_step(batch)["kl_to_ref"] == pytest.approx(targets.kl_to_ref)


def _clipped_params(model_dir, batch_table, **algo_kw) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    algo = AlgorithmConfig(policy_ratio="proximal", is_weight="none", clip_eps_low=0.2, **algo_kw)
    config = LearnerConfig(model=str(model_dir), zero_stage=0, dtype="fp32", micro_batch_size=3, lr=2e-2)
    engine = LearnerEngine(config, algo)
    metrics = engine.train_step(build_train_batch(batch_table, 0, 2, algo))
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}, metrics


def test_the_clip_acts_from_the_second_update_and_never_with_one(tiny_llama):
    """Finding #21.2: with one update per batch ``pi / pi_prox == 1`` and ``clip_eps_high`` changes nothing
    (bit-identical parameters); with 2 mini-batches the second update is clipped against the proximal logprobs
    computed before the first, so its gradient, and the parameters after the step, depend on ``clip_eps_high``."""
    table = _table(2, seed=5)  # 6 rows: 2 mini-batches of 3
    one_tight, m1 = _clipped_params(tiny_llama, table, clip_eps_high=0.05)
    one_loose, _ = _clipped_params(tiny_llama, table, clip_eps_high=10.0)
    assert all(torch.equal(one_tight[n], one_loose[n]) for n in one_tight), "one update: the clip must be inert"
    assert m1["ppo_clip_frac"] == 0.0 and m1["updates"] == 1.0
    two_tight, m2 = _clipped_params(tiny_llama, table, clip_eps_high=0.05, mini_batches=2)
    two_loose, m2_loose = _clipped_params(tiny_llama, table, clip_eps_high=10.0, mini_batches=2)
    assert m2["updates"] == 2.0 and m2["micro_batches"] == 2.0
    assert m2["ppo_clip_frac"] > 0.0 and m2_loose["ppo_clip_frac"] < m2["ppo_clip_frac"]
    differ = [n for n in two_tight if not torch.equal(two_tight[n], two_loose[n])]
    assert len(differ) > len(two_tight) // 2, f"only {differ} depend on clip_eps_high"
    two_epochs, m3 = _clipped_params(tiny_llama, table, clip_eps_high=0.05, ppo_epochs=2)
    assert m3["updates"] == 2.0 and m3["ppo_clip_frac"] > 0.0
