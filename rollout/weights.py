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
        retie_word_embeddings(self.model_runner.get_model())  # type: ignore[attr-defined]
        return len(tensors)


def retie_word_embeddings(model) -> bool:
    """Make a tied output head serve the input embedding just loaded; returns whether the model ties them.

    vLLM 0.32's in-place reload (``reload_weights``, layerwise) restores a tied ``lm_head`` it loads no weight into
    ("ParallelLMHead: Failed to load weights") with its old tensor, untying it: every policy version after the first
    then sampled through the initial (or, with ``load_format: dummy``, random) output head while the embedding
    trained. vLLM since fixed tying upstream (vllm-project/vllm#51665, #52147). Here the head is tied again with
    vLLM's own ``ParallelLMHead.tie_weights`` and its quant method re-processes it (on CPU that re-packs the head's
    GEMM from the new weight, ``dispatch_cpu_unquantized_gemm``).

    Raises:
        RuntimeError: the config ties the embeddings but the model has no ``lm_head`` and ``model.embed_tokens``.
    """
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return False
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or not hasattr(head, "tie_weights"):
        raise RuntimeError(f"{type(model).__name__} ties its word embeddings but has no lm_head and model.embed_tokens "
                           "to tie after a weight update")
    if head.weight is not embed.weight:
        head.tie_weights(embed)
    head.quant_method.process_weights_after_loading(head)
    return True


def expected_shapes(model_dir: Path) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """HF tensor name -> shape from the checkpoint headers, and the names that may be omitted. A folder without
    safetensors (``load_format: dummy``: config and tokenizer only) gives the shapes of the model its ``config.json``
    builds (``config_shapes``)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        shapes = config_shapes(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings"))
    optional: set[str] = set()
    if tied and "model.embed_tokens.weight" in shapes:
        shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
        optional.add("lm_head.weight")  # vLLM ignores it: the head reuses the embedding
    return shapes, optional


def config_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of the model ``{model_dir}/config.json`` describes, built on PyTorch's meta device
    (``AutoModelForCausalLM.from_config``: no memory, no weights read). Non-persistent buffers are left out, as a
    checkpoint leaves them out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def write_safetensors(tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``tensors`` to a fresh file (``/dev/shm`` if it has room, else the temp dir)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    use_shm = _SHM.is_dir() and shutil.disk_usage(_SHM).free > 2 * nbytes + (64 << 20)
    fd, name = tempfile.mkstemp(prefix="gyre-weights-", suffix=".safetensors",
                                dir=_SHM if use_shm else None)
    os.close(fd)
    save_file(tensors, name)
    return Path(name)

