from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.tiny_model import build_tiny_classifier, build_tiny_llama

# On CPU vLLM runs its model worker in a process of its own, beside the engine core: one more spawn and
# ~6 s of imports per engine start, and the suite starts ~20 engines (every whole run, every rollout
# restart). With this off the worker runs inside the engine-core process (vLLM's layout for one GPU);
# inherited by the Ray clusters and services the tests start. The two-process layout, where weight updates
# cross a process boundary as in `make run`, stays tested: tests/integration/test_engine.py and
# test_weight_sync.py switch it back on (`vllm_worker_process`).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# Ray 2.60 turns token auth on for every private local Ray and, when it finds no token, writes one to
# ~/.ray/auth_token. The tests keep token auth on (the stock behaviour users get) but read their token from a
# file of their own, inherited by every Ray and gyre process they start: they never write the user's ~/.ray.
if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
    _token = Path(tempfile.mkdtemp(prefix="gyre-test-ray-")) / "auth_token"
    _token.write_text(secrets.token_hex(32))
    _token.chmod(0o600)
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(_token)

# Experiment trackers (services.control.outputs.tracking) in tests: W&B never reaches the network, and trackio writes a
# store of the test session's own, never the user's $HF_HOME/trackio (trackio reads TRACKIO_DIR at import).
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="gyre-test-trackio-")


BUILD_DEEPSPEED_OP = "from gyre.learner.jit_ops import load_comm_op\nload_comm_op()\n"
"""The learners' own loader (``learner.jit_ops``: its flock, and the venv's ninja whatever ``PATH`` says)."""


def pytest_sessionstart(session):
    """Build DeepSpeed's CPU communication op once, before any test starts a learner. A learner that builds it
    holds a file lock in ``TORCH_EXTENSIONS_DIR`` for the build (~50 s); the crash tests ``kill -9`` learners,
    and a builder killed there leaves the lock behind, so every later learner waits for it forever. Once it is
    built, learners only load it. Runs in the xdist controller (or the only process), not in each worker, and
    only when ``$TORCH_EXTENSIONS_DIR`` (``make test`` sets it) has no build yet.

    (Seen with git worktrees that reach the venv through a symlink: their Python's ``sys.prefix`` differs, so
    the op's source paths and ninja's command differ, every worktree rebuilds it, and a partial-restart test's
    ``kill -9`` hit a building learner.)"""
    built = Path(os.environ.get("TORCH_EXTENSIONS_DIR", "/nonexistent")) / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    if hasattr(session.config, "workerinput") or built.is_file():
        return
    subprocess.run([sys.executable, "-c", BUILD_DEEPSPEED_OP], check=True, capture_output=True, timeout=900)


@pytest.fixture(scope="module")
def vllm_worker_process():
    """vLLM's own CPU layout for a module (engine core and model worker in separate processes)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        yield


@pytest.fixture(scope="session")
def tiny_classifier(tmp_path_factory):
    """Path of a tiny random one-label Llama sequence classifier (a reward model), built once per session."""
    return build_tiny_classifier(tmp_path_factory.mktemp("tiny-rm"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Path of a tiny random Llama HF folder (SmolLM2 tokenizer), built once per test session."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
