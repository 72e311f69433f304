"""The rollout side of the weights path that runs without gRPC: how versions get into vLLM's worker processes.
How they travel (the transport configs ``EngineConfig.weight_transport`` chooses between) is the contract
``proto/weight_transport.py``.

- ``GyreWorkerExtension`` is mixed into vLLM's worker class (``worker_extension_cls``) and runs in the worker
  process: a version arrives as a safetensors file (no pickle), or over NCCL through ``register_nccl_backend``
  (vLLM is imported only there, the NCCL transport's worker-side receiver). The rest runs in the rollout
  service.
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
NCCL_BACKEND = "gyre_nccl"
"""vLLM ``WeightTransferConfig.backend`` name of ``register_nccl_backend``'s engine."""


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


def register_nccl_backend() -> None:
    """Register vLLM weight-transfer backend ``gyre_nccl`` (idempotent; call in every process).

    It is vLLM's dense NCCL engine with the receive step replaced: every tensor of the update is
    received into a fresh buffer (``proto.broadcast.receive_verified``), every checksum from the
    manifest is verified, and only then are the weights loaded with vLLM's layerwise reload; a failed
    check raises ``ChunkError`` with the model untouched. ``start/finish_weight_update`` are no-ops.
    """
    from dataclasses import dataclass

    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine, NCCLWeightTransferUpdateInfo

    if NCCL_BACKEND in WeightTransferEngineFactory._registry:
        return

    @dataclass
    class GyreNcclUpdateInfo(NCCLWeightTransferUpdateInfo):
        checksums: list[int]
        checksum_kind: str
        drain: bool = False

    class GyreNcclWeightTransferEngine(NCCLWeightTransferEngine):
        update_info_cls = GyreNcclUpdateInfo

        def start_weight_update(self) -> None:
            pass  # layerwise reload starts in receive_weights, once every checksum passed

        def finish_weight_update(self) -> None:
            pass

        def receive_weights(self, update_info: GyreNcclUpdateInfo) -> None:
            load_broadcast_verified(self, update_info)

    WeightTransferEngineFactory.register_engine(NCCL_BACKEND, GyreNcclWeightTransferEngine)


def load_broadcast_verified(engine, info) -> int:
    """Worker side of one ``gyre_nccl`` update on vLLM's NCCL ``engine``; returns tensors loaded.

    ``info.drain`` (a version the engine refused by name or shape) or an unknown checksum kind: receive every
    tensor and drop it, so the learner and the other ranks are not left waiting in the broadcast.

    Raises:
        ChunkError: unknown checksum kind, dtype, or a checksum mismatch (nothing loaded).
    """
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from gyre.proto.broadcast import receive_verified
    from gyre.proto.tensor_chunks import DTYPES, ChunkError
    from gyre.proto.manifest import CHECKSUM_KIND, TensorMeta

    unknown = sorted(set(info.dtype_names) - set(DTYPES))
    if unknown:  # the byte count of each broadcast is unknowable: nothing can be received, not even drained
        raise ChunkError(f"unknown dtype(s) {unknown}; expected one of {sorted(DTYPES)}")
    group = engine.model_update_group
    if group is None:
        raise RuntimeError("gyre_nccl: init_weight_transfer_engine was not called")
    stream = torch.cuda.current_stream()
    broadcast = lambda t, src: group.broadcast(t, src=src, stream=stream)  # noqa: E731
    drain = getattr(info, "drain", False)
    if drain or info.checksum_kind != CHECKSUM_KIND:  # take the bytes, load nothing
        for dtype, shape in zip(info.dtype_names, info.shapes, strict=True):
            broadcast(torch.empty(tuple(shape), dtype=DTYPES[dtype], device=engine.device), 0)
        if drain:
            return 0
        raise ChunkError(f"checksum kind {info.checksum_kind!r}, expected {CHECKSUM_KIND!r}")
    metas = [TensorMeta(n, d, tuple(s), 0, c)
             for n, d, s, c in zip(info.names, info.dtype_names, info.shapes, info.checksums, strict=True)]
    tensors = receive_verified(broadcast, metas, engine.device)
    initialize_layerwise_reload(engine.model)
    engine.model.load_weights(tensors)
    finalize_layerwise_reload(engine.model, engine.model_config)
    return len(tensors)
