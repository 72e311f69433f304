"""A pre-populated local Hugging Face cache (the tests never reach a hub): ``models--org--name/snapshots/<commit>``
holding a model folder's files, and ``refs/main`` naming that commit, as ``huggingface_hub`` lays them out."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

TINY_ID = "gyre-test/tiny-llama"
"""The Hub id the tests give the tiny random Llama."""


def populate_hf_cache(cache: Path, repo_id: str, src: Path) -> str:
    """Put the files of the model folder ``src`` into the HF hub cache ``cache`` as ``repo_id`` at one commit
    (a 40-hex id derived from the files' bytes) and point ``refs/main`` at it. Returns the commit."""
    digest = hashlib.sha1()
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        digest.update(f.name.encode() + f.read_bytes())
    commit = digest.hexdigest()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return commit


def use_hf_cache(monkeypatch: pytest.MonkeyPatch, cache: Path, offline: bool = True) -> None:
    """Point this process (and the processes it starts) at ``cache``: the env vars for children, and
    ``huggingface_hub.constants``, which read them once at import, for this process."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
