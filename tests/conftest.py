from __future__ import annotations

import pytest

from tests.tiny_model import build_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Path of a tiny random Llama HF folder (SmolLM2 tokenizer), built once per test session."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
