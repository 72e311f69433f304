"""How a policy version gets into vLLM's worker processes, whichever transport brought it to the rollout service
(``proto/weight_transport.py``): as a safetensors file (no pickle) that ``GyreWorkerExtension``, mixed into vLLM's
worker class (``worker_extension_cls``), loads in the worker process. The rest runs in the rollout service.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

_SHM = Path("/dev/shm")


class GyreWorkerExtension:
    """Mixed into vLLM's worker class by qualified name; runs in the worker process."""

    def gyre_load_weights_file(self, path: str) -> int:
        """Load HF-named tensors from the safetensors file at ``path``; return how many."""
        tensors = load_file(path, device="cpu")
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)


def expected_shapes(model_dir: Path) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """HF tensor name -> shape from the checkpoint headers, and the names that may be omitted."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    config = json.loads((model_dir / "config.json").read_text())
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings"))
    optional: set[str] = set()
    if tied and "model.embed_tokens.weight" in shapes:
        shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
        optional.add("lm_head.weight")  # vLLM ignores it: the head reuses the embedding
    return shapes, optional


def write_safetensors(tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``tensors`` to a fresh file (``/dev/shm`` if it has room, else the temp dir)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    use_shm = _SHM.is_dir() and shutil.disk_usage(_SHM).free > 2 * nbytes + (64 << 20)
    fd, name = tempfile.mkstemp(prefix="gyre-weights-", suffix=".safetensors",
                                dir=_SHM if use_shm else None)
    os.close(fd)
    save_file(tensors, name)
    return Path(name)

