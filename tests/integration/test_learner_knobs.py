"""Learner config knobs of the scaling article on the tiny Llama (real DeepSpeed, CPU/gloo): ZeRO-Offload
of the optimizer, gradient accumulation over micro-batches, and per-step communication time."""

from __future__ import annotations

import pytest
import torch

from gyre.learner.config import LearnerConfig
from gyre.learner.ds_setup import build_ds_config
from tests.integration.test_learner_async_save import _step, _weights
from tests.integration.test_learner_engine import _engine


def test_ds_config_for_offload_and_comm_logging(tiny_llama):
    ds = build_ds_config(LearnerConfig(model=str(tiny_llama), zero_stage=2, offload_optimizer="cpu", log_comm_time=True))
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_force_ds_cpu_optimizer"] is False and ds["comms_logger"]["enabled"] is True
    plain = build_ds_config(LearnerConfig(model=str(tiny_llama)))  # comm timing is off by default
    assert "offload_optimizer" not in plain["zero_optimization"] and "comms_logger" not in plain
    with pytest.raises(ValueError, match="offload_optimizer='cpu' needs zero_stage >= 1"):
        LearnerConfig(model=str(tiny_llama), zero_stage=0, offload_optimizer="cpu")


def test_offloaded_optimizer_takes_the_same_step(tiny_llama):
    """ZeRO-Offload moves where AdamW runs, not what it computes: fp32, same batches → bit-identical
    weights (both run torch's AdamW on the CPU here; measured max |Δθ| = 0.0)."""
    results = []
    for offload in ("none", "cpu"):
        engine = _engine(tiny_llama, dtype="fp32", offload_optimizer=offload)
        initial = _weights(engine)
        for seed in range(2):
            _step(engine, seed)
        results.append(_weights(engine))
    plain, offloaded = results
    assert any(not torch.equal(plain[name], initial[name]) for name in plain), "the steps must move the weights"
    for name in plain:
        torch.testing.assert_close(offloaded[name], plain[name], atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_step_reports_micro_batches_and_comm_time(tiny_llama):
    from gyre.learner.batch import build_train_batch
    from tests.integration.test_learner_engine import ALGO, _table

    engine = _engine(tiny_llama, micro_batch_size=2, log_comm_time=True)
    metrics = engine.train_step(build_train_batch(_table(num_groups=2, group_size=3), 0, 0, ALGO))
    assert metrics["micro_batches"] == 3.0  # 6 sequences / 2 per micro-batch, one optimizer step
    assert metrics["comm_s"] > 0.0  # ZeRO-2 all-reduces gradients even in a world of one
    assert 0.0 < metrics["optimizer_step_s"] < metrics["step_time_s"]


def test_reference_ds_config_is_zero3_inference_offloaded_with_the_optimizer(tiny_llama):
    from gyre.learner.ds_setup import build_ref_ds_config

    ref = build_ref_ds_config(LearnerConfig(model=str(tiny_llama), zero_stage=3, dtype="bf16", micro_batch_size=4))
    assert ref["zero_optimization"] == {"stage": 3} and ref["bf16"] == {"enabled": True}
    assert "optimizer" not in ref and ref["train_micro_batch_size_per_gpu"] == 4  # DeepSpeed wants a batch size
    offloaded = build_ref_ds_config(LearnerConfig(model=str(tiny_llama), zero_stage=3, dtype="fp32",
                                                  offload_optimizer="cpu"))
    assert offloaded["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert offloaded["bf16"] == {"enabled": False}
