"""Exact resume: a learner killed (kill -9, or mid-save) and resumed from ``find_latest_verified`` ends
with parameters bit-identical to an uninterrupted run fed the same batches.

Every run is a fresh ``python`` process (``learner_resume_proc``; never a fork), on the tiny Llama with
attention dropout 0.1 so that training consumes the torch RNG, fp32 ZeRO-2 on CPU (gloo). The
sabotage cases prove the comparison would catch a resume that drops optimizer state, RNG or the KL
controller's state (``learner.algo.kl_control``, trained with ``--kl-adaptive``).
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

from gyre.learner.checkpoint import store as ckpt

pytestmark = pytest.mark.slow  # learner processes killed and resumed (~3 min): `make test`, not `make test-fast`

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


@pytest.fixture(scope="module")
def kl_reference(setup):
    """The uninterrupted run under the adaptive KL controller: final parameters and its per-step coefficients."""
    model, base, _ = setup
    assert run(model, base / "kl-ref", base / "kl-ref.safetensors", "--kl-adaptive") == 0
    return load_file(base / "kl-ref.safetensors"), json.loads((base / "kl-ref.safetensors.kl.json").read_text())


def test_adaptive_kl_coefficient_resumes_bit_identically(setup, kl_reference):
    """Killed after step 3 (checkpoint of step 2), resumed: steps 3-4 use exactly the coefficients of the
    uninterrupted run, and the final controller value and parameters are bit-identical."""
    model, base, _ = setup
    params, ref = kl_reference
    coefs = [c for _, c, _ in ref["steps"]]
    assert len(set(coefs)) == STEPS and coefs[0] == 0.05  # the controller moved every step, from kl_coef
    root = crashed(setup, "kl-crash", "--kill-after", "3", "--kl-adaptive")
    assert ckpt.verify(root / "global_step_2").kl_ctrl == {"type": "adaptive", "kl_coef": coefs[2], "updates": 2}
    assert run(model, root, base / "kl-resumed.safetensors", "--resume", "--kl-adaptive") == 0
    resumed = json.loads((base / "kl-resumed.safetensors.kl.json").read_text())
    assert resumed["steps"] == ref["steps"][2:] and resumed["final"] == ref["final"]  # == on floats: exact
    assert equal(load_file(base / "kl-resumed.safetensors"), params)


def test_a_resume_missing_the_kl_controller_state_is_caught(setup, kl_reference):
    model, base, _ = setup
    params, ref = kl_reference
    root = crashed(setup, "kl-sabotage", "--kill-after", "3", "--kl-adaptive")
    assert run(model, root, base / "kl-broken.safetensors", "--resume", "--kl-adaptive", "--sabotage", "kl") == 0
    broken = json.loads((base / "kl-broken.safetensors.kl.json").read_text())
    assert broken["steps"][0][1] == 0.05 != ref["steps"][2][1]  # restarted at kl_coef
    assert broken["final"] != ref["final"] and not equal(load_file(base / "kl-broken.safetensors"), params)
