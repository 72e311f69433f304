"""Data parallelism (``LearnerConfig.batch_split: shard``): two gloo ranks (fresh ``reshard_proc`` processes)
each train on their own half of every batch, and after 3 steps the weights match one rank training on the
whole batch up to float summation order; the step metrics (loss, tokens, importance ratios) cover the
whole batch on rank 0, and the micro-batch count shows each rank really ran only its half (2 + 2 micro-batches
of at most 2 rows for 3 rows per rank, against 3 for 6 rows on one rank). AdamW is nearly invariant to the
gradient's scale, so the weights alone would not notice a shard that forgot to multiply its loss by the world
size (DeepSpeed averages gradients over ranks): the all-reduced ``grad_norm`` does — it halves (checked by
running this test with ``grad_scale=1``: weights still within tolerance, grad_norm off by 2x)."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_learner_reshard import launch, max_abs_diff, result, wait

pytestmark = pytest.mark.slow

TOLERANCE = 2e-5
"""Max |Δθ| between 2 sharded ranks and 1 rank after 3 fp32 AdamW steps (lr 1e-3): summation order only."""


def test_sharded_ranks_train_like_one_rank_on_the_whole_batch(tiny_llama, tmp_path):
    flags = ("--zero-stage", "2", "--dtype", "fp32")
    wait(launch(1, tiny_llama, tmp_path / "w1", tmp_path / "w1.safetensors", *flags),
         launch(2, tiny_llama, tmp_path / "w2", tmp_path / "w2.safetensors", *flags, "--batch-split", "shard"))
    one, doc1 = result(tmp_path / "w1.safetensors")
    two, doc2 = result(tmp_path / "w2.safetensors")
    assert doc1["step"] == doc2["step"] == 3 and doc2["world_size"] == 2
    assert max_abs_diff(one, two) <= TOLERANCE
    m1 = json.loads((tmp_path / "w1.safetensors.metrics.json").read_text())
    m2 = json.loads((tmp_path / "w2.safetensors.metrics.json").read_text())
    assert m1["micro_batches"] == 3 and m2["micro_batches"] == 4  # 6 rows on one rank; 3 + 3 on two
    for key in ("grad_norm", "loss", "tokens", "response_tokens", "is_ratio_mean", "is_ess_frac", "entropy", "reward_mean"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
