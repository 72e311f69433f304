"""What every whole-run test asserts about training itself: the learner's steps had gradients and the policy it
exported is not the model it started from (a run whose steps all have ``grad_norm == 0`` would pass any
"bit-identical after faults" or "nothing lost" check while training nothing)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from gyre.services.control.outputs.report import read_metrics


def step_rows(run_dir: Path) -> list[dict]:
    """The learner's per-step rows of ``{run_dir}/metrics.jsonl`` (those with a ``loss``)."""
    return [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "loss" in r]


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``model_dir`` (an HF folder), as float32."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    assert files, f"no *.safetensors in {model_dir}"
    return {k: v.float() for f in files for k, v in load_file(str(f)).items()}


def training_summary(run_dir: Path, initial_model: Path) -> dict:
    """How much a finished run trained: ``steps`` (learner step rows), ``steps_with_grad`` (rows with
    ``grad_norm > 0``), ``tensors`` (tensor names shared by ``initial_model`` and ``{run_dir}/final_policy``) and
    ``tensors_moved`` (those not bit-equal), plus ``moving_steps`` and ``moved_names`` (lists) for messages."""
    rows = step_rows(run_dir)
    before, after = load_weights(initial_model), load_weights(Path(run_dir) / "final_policy")
    common = sorted(before.keys() & after.keys())
    moved = [k for k in common if not torch.equal(before[k], after[k])]
    moving = [r["step"] for r in rows if r["grad_norm"] > 0]
    return {"steps": len(rows), "steps_with_grad": len(moving), "tensors": len(common), "tensors_moved": len(moved),
            "moving_steps": moving, "moved_names": moved}


def assert_trained(run_dir: Path, initial_model: Path, min_fraction: float = 0.8) -> list[dict]:
    """Assert that at least ``min_fraction`` of the run's learner steps had ``grad_norm > 0``, and that the
    exported ``final_policy`` differs from ``initial_model`` in more than half of their shared tensors.

    Returns the step rows. Raises ``AssertionError`` naming the steps or tensors at fault.
    """
    rows = step_rows(run_dir)
    assert rows, f"no learner step rows in {run_dir}/metrics.jsonl"
    t = training_summary(run_dir, initial_model)
    assert t["steps_with_grad"] >= min_fraction * len(rows), (
        f"only steps {t['moving_steps']} of {[r['step'] for r in rows]} had grad_norm > 0: the run did not train")
    assert t["tensors"], f"final_policy shares no tensor name with {initial_model}"
    assert t["tensors_moved"] * 2 > t["tensors"], (
        f"only {t['tensors_moved']} of {t['tensors']} tensors moved from the initial model: {t['moved_names'][:5]}")
    return rows
