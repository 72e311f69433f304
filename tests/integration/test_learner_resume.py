"""Exact resume: a learner killed (kill -9, or mid-save) and resumed from ``find_latest_verified`` ends
with parameters bit-identical to an uninterrupted run fed the same batches.

Every run is a fresh ``python`` process (``learner_resume_proc``; never a fork), on the tiny Llama with
attention dropout 0.1 so that training consumes the torch RNG, fp32 ZeRO-2 on CPU (gloo). The
sabotage cases prove the comparison would catch a resume that drops optimizer state or RNG.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from learner import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def run(model: Path, root: Path, out: Path, *args: str, fault: str = "") -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK",
                                                              "WORLD_SIZE")}
    env |= {"PYTHONPATH": str(REPO), "GYRE_FAULT_POINT": fault}
    cmd = [sys.executable, "-m", "tests.integration.learner_resume_proc", str(model), str(root), str(out),
           str(STEPS), *args]
    return subprocess.run(cmd, env=env, cwd=REPO, timeout=300, capture_output=True).returncode


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    """The dropout model and the uninterrupted reference run's final parameters."""
    base = tmp_path_factory.mktemp("resume")
    model = base / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    assert run(model, base / "ref", base / "ref.safetensors") == 0
    return model, base, load_file(base / "ref.safetensors")


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def crashed(setup, name: str, *args: str, fault: str = "") -> Path:
    model, base, _ = setup
    root = base / name
    rc = run(model, root, base / f"{name}.safetensors", *args, fault=fault)
    assert rc in (-signal.SIGKILL, 137), f"the learner was meant to die, exit code {rc}"
    return root


@pytest.mark.parametrize("crash, latest", [
    (("--kill-after", "3"), "global_step_2"),  # kill -9 after training step 3, before saving it
    ((), "global_step_2"),  # dies inside the save of step 3, before the rename
    (("--async-save",), "global_step_2"),  # background save of step 3 dies after its first file
], ids=["kill9_between_checkpoints", "exit_during_save_before_rename", "async_save_dies_mid_write"])
def test_killed_learner_resumes_bit_identically(setup, crash, latest):
    model, base, reference = setup
    fault = {(): "learner.ckpt.before_rename#3", ("--async-save",): "learner.ckpt.mid_write#3"}.get(crash, "")
    root = crashed(setup, f"crash{len(crash)}", *crash, fault=fault)
    assert ckpt.find_latest_verified(root) == root / latest
    assert run(model, root, base / "resumed.safetensors", "--resume") == 0
    assert equal(load_file(base / "resumed.safetensors"), reference)
    meta = ckpt.verify(ckpt.find_latest_verified(root))
    assert (meta.step, meta.policy_version, meta.fingerprint) == (STEPS, STEPS, "fixed-batches")


@pytest.mark.parametrize("sabotage", ["optimizer", "rng"])
def test_a_resume_missing_optimizer_or_rng_state_is_caught(setup, sabotage):
    model, base, reference = setup
    root = crashed(setup, f"sabotage-{sabotage}", "--kill-after", "3")
    assert run(model, root, base / "broken.safetensors", "--resume", "--sabotage", sabotage) == 0
    assert not equal(load_file(base / "broken.safetensors"), reference)
