from __future__ import annotations

import os

import pytest

from tests.tiny_model import build_tiny_llama

# On CPU vLLM runs its model worker in a process of its own, beside the engine core: one more spawn and
# ~6 s of imports per engine start, and the suite starts ~20 engines (every whole run, every rollout
# restart). With this off the worker runs inside the engine-core process (vLLM's layout for one GPU);
# inherited by the Ray clusters and services the tests start. The two-process layout, where weight updates
# cross a process boundary as in `make run`, stays tested: tests/integration/test_engine.py and
# test_weight_sync.py switch it back on (`vllm_worker_process`).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="module")
def vllm_worker_process():
    """vLLM's own CPU layout for a module (engine core and model worker in separate processes)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        yield


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Path of a tiny random Llama HF folder (SmolLM2 tokenizer), built once per test session."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
