"""Lockstep's exact-resume claim on a real CUDA GPU (skipped without one; CI has none): a learner process with
deterministic kernels (``LockstepPublishing.prepare_process``) that is SIGKILLed after publishing a version it
had not checkpointed, and resumed from the checkpoint before it, re-publishes that version and every later one
bit-identical (sha256 of the published weights, what ``VersionStore`` checks), and so does an uninterrupted
run in a fresh process. Every step's hash differs from the others', so the comparison can tell states apart.

``GYRE_GPU_TEST_ON_CPU=1`` runs it on CPU (gloo, the tiny shape) to check the harness without a GPU.
Appends one JSON line per config to ``GYRE_GPU_RESULTS`` when set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gpu.test_learner_cuda import ON_CPU, SHAPE, SIZE, build_llama

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not (ON_CPU or torch.cuda.is_available()),
                                reason="needs a CUDA GPU (GYRE_GPU_TEST_ON_CPU=1 runs it on CPU)")
REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def _proc(model: Path, root: Path, out: Path, *extra: str) -> int:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "tests.gpu.lockstep_proc", str(model), str(root), str(out),
                           str(STEPS), *extra], cwd=REPO, env=env, timeout=600).returncode


@pytest.mark.parametrize(("dtype", "zero"), [("bf16", 2)], ids=["bf16-zero2"])  # the GPU recipes' setting
def test_a_killed_lockstep_learner_republishes_every_version_bit_identical(tmp_path, dtype, zero):
    model = build_llama(tmp_path / "model", SHAPE)
    opts = ("--dtype", dtype, "--zero", str(zero))
    t0 = time.monotonic()
    assert _proc(model, tmp_path / "a", tmp_path / "a.json", *opts) == 0
    clean = json.loads((tmp_path / "a.json").read_text())
    assert _proc(model, tmp_path / "b", tmp_path / "b.json", *opts, "--kill-after", "3") == -9
    killed = json.loads((tmp_path / "b.json").read_text())["versions"]
    assert sorted(killed, key=int) == ["1", "2", "3"]  # version 3 was published, then lost with the process
    assert _proc(model, tmp_path / "b", tmp_path / "b.json", *opts, "--resume") == 0
    resumed = json.loads((tmp_path / "b.json").read_text())["versions"]

    line = json.dumps({"test": "lockstep_cuda", "config": f"{dtype}-zero{zero}", "size": SIZE,
                       "device": clean["gpu"] or clean["device"], "steps": STEPS,
                       "killed_published": killed, "resumed": resumed, "clean": clean["versions"],
                       "bit_identical": resumed == clean["versions"] and killed["3"] == clean["versions"]["3"],
                       "wall_s": round(time.monotonic() - t0, 1)})
    print(line)
    if os.environ.get("GYRE_GPU_RESULTS"):
        with open(os.environ["GYRE_GPU_RESULTS"], "a") as f:
            f.write(line + "\n")
    assert clean["device"].startswith("cpu" if ON_CPU else "cuda")
    assert killed["3"] == clean["versions"]["3"]  # the version the killed learner published...
    assert resumed == clean["versions"]  # ...and every other one, re-published bit-identical after the resume
    # the comparison can tell states apart: every step published weights with a hash of their own
    assert len(set(clean["versions"].values())) == STEPS
