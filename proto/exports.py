"""HF export folders that carry a policy version: the learner writes one (``gyre export``, the learner actor's
export), a rollout bootstraps from the newest one when the learner does not answer in time
(``services.rollout.transport.bootstrap``), ``gyre eval`` reads its version. The contract is one file beside
the weights: ``gyre_version.json`` = ``{"policy_version": N}``.
"""

from __future__ import annotations

import json
from pathlib import Path

import structlog
from safetensors.torch import load_file

log = structlog.get_logger("weights")
VERSION_FILE = "gyre_version.json"
"""Written inside an HF export folder: ``{"policy_version": N}``."""


def write_export_version(export_dir: Path, version: int) -> Path:
    """Record ``version`` next to an HF export (``{export_dir}/gyre_version.json``); returns the file."""
    path = Path(export_dir) / VERSION_FILE
    path.write_text(json.dumps({"policy_version": int(version)}))
    return path


def newest_export(bootstrap_dir: Path) -> tuple[int, Path] | None:
    """The export with the highest recorded version: ``bootstrap_dir`` itself or any direct subfolder
    holding ``gyre_version.json`` and ``*.safetensors``. Folders without a version file are skipped
    (logged): an unknown version cannot be claimed. ``None`` when there is none.

    Raises:
        ValueError: a version file that is not ``{"policy_version": <int >= 0>}`` (names the file).
    """
    root = Path(bootstrap_dir)
    found: list[tuple[int, Path]] = []
    for folder in [root, *sorted(p for p in root.iterdir() if p.is_dir())] if root.is_dir() else []:
        if not any(folder.glob("*.safetensors")):
            continue
        vfile = folder / VERSION_FILE
        if not vfile.is_file():
            log.warning("bootstrap_export_without_version", path=str(folder), expected=VERSION_FILE)
            continue
        version = json.loads(vfile.read_text()).get("policy_version")
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"{vfile}: policy_version ({version!r}) must be an integer >= 0")
        found.append((version, folder))
    return max(found, key=lambda f: f[0]) if found else None


def load_export(folder: Path) -> list[tuple[str, "object"]]:
    """HF-named tensors of every ``*.safetensors`` file in ``folder`` (CPU), sorted by name."""
    tensors: dict = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(file, device="cpu"))
    return sorted(tensors.items())
