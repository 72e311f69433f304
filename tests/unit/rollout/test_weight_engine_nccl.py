"""RolloutEngine's NCCL update path (a ``VersionManifest``) against a recording stand-in for vLLM's
AsyncLLM: the order of vLLM calls, what crosses to the workers, and refusals that keep the old version.
The worker side (``rollout.weights.load_broadcast_verified``) runs with a gloo-free fake group."""

import asyncio
import inspect
import reprlib
import types
import typing
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from vllm.v1.engine.async_llm import AsyncLLM

from gyre.proto.manifest import VersionManifest, tensor_metas
from gyre.rollout.config import EngineConfig
from gyre.proto.weight_transport import NcclTransportConfig
from gyre.rollout.engine import EngineFailedError, RolloutEngine, WeightMismatchError
from gyre.rollout.weights import load_broadcast_verified


class RecordingLLM:
    """Records every call the engine makes; ``fail`` makes ``update_weights`` raise it, ``hang`` makes it
    never return. Each call is first bound to the real ``AsyncLLM`` method of that name (vllm 0.32): a method
    it lacks, a sync method, arguments its signature does not take, or a value its annotation rules out
    (a class, a ``Literal``) raises ``TypeError``/``AttributeError`` here, so this stand-in cannot drift from
    the API it stands in for. Returns ``True`` where the real method returns ``bool``, else ``None``."""

    def __init__(self, fail: BaseException | None = None, hang: bool = False) -> None:
        self.calls, self.fail, self.hang = [], fail, hang

    def __getattr__(self, name):
        real = getattr(AsyncLLM, name)  # AttributeError: vLLM has no such method
        if not inspect.iscoroutinefunction(real):
            raise TypeError(f"AsyncLLM.{name} is not a coroutine function; the stand-in only stands in for those")
        hints = typing.get_type_hints(real)

        async def call(*args, **kwargs):
            bound = inspect.signature(real).bind(self, *args, **kwargs)  # TypeError: not the real signature
            for param, value in list(bound.arguments.items())[1:]:
                if not _fits(value, hints.get(param)):
                    raise TypeError(f"AsyncLLM.{name}({param}={reprlib.repr(value)}): not a {hints[param]}")
            self.calls.append((name, args, kwargs))
            if name == "update_weights" and self.fail is not None:
                raise self.fail
            if name == "update_weights" and self.hang:
                await asyncio.sleep(3600)  # a learner that died mid-broadcast
            return True if hints.get("return") is bool else None
        return call


def _fits(value, hint) -> bool:
    """Whether ``value`` can be of type ``hint``: plain classes, ``Literal``s and unions of them are checked;
    anything else (no annotation, ``Any``, generics such as ``list[str]``) fits."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return any(_fits(value, option) for option in typing.get_args(hint))
    return isinstance(value, hint) if origin is None and isinstance(hint, type) else True


def _engine(tiny_llama, llm, timeout_s=300.0):
    nccl = NcclTransportConfig(master_address="127.0.0.1", master_port=29500, world_size=2, rank_offset=1,
                               broadcast_timeout_s=timeout_s)
    engine = RolloutEngine(EngineConfig(model=str(tiny_llama), weight_transport=nccl), llm, initial_version=3)
    loop = asyncio.new_event_loop()
    engine._nccl_ready = loop.create_future()
    engine._nccl_ready.set_result(None)
    return engine, loop


def _manifest(tiny_llama, version=4, extra=()):
    named = sorted(load_file(tiny_llama / "model.safetensors").items()) + list(extra)
    return VersionManifest(version, tuple(tensor_metas(named)))


def test_manifest_update_drives_vllm_weight_transfer_api_in_order(tiny_llama):
    llm = RecordingLLM()
    engine, loop = _engine(tiny_llama, llm)
    manifest = _manifest(tiny_llama)
    loop.run_until_complete(engine.update_weights(4, manifest))
    names = [c[0] for c in llm.calls]
    assert names == ["pause_generation", "start_weight_update", "update_weights", "finish_weight_update",
                     "reset_prefix_cache", "update_weight_version", "resume_generation"]
    info = llm.calls[2][1][0].update_info
    assert info["names"] == [m.name for m in manifest.tensors]
    assert info["checksums"] == [m.checksum for m in manifest.tensors] and info["checksum_kind"] == "wsum64-v1"
    assert engine.version == 4 and llm.calls[5][1] == ("4",)


def test_checksum_refusal_in_the_worker_keeps_the_old_version_and_resumes(tiny_llama):
    llm = RecordingLLM(fail=RuntimeError("Worker failed: ChunkError(\"tensor 'x': checksum 0x1 != sent 0x2\")"))
    engine, loop = _engine(tiny_llama, llm)
    with pytest.raises(WeightMismatchError, match="broadcast refused, old weights kept.*'x': checksum"):
        loop.run_until_complete(engine.update_weights(4, _manifest(tiny_llama)))
    assert engine.version == 3 and llm.calls[-1][0] == "resume_generation"
    llm.fail = None
    loop.run_until_complete(engine.update_weights(5, _manifest(tiny_llama, 5)))  # still alive
    assert engine.version == 5


def test_a_stalled_broadcast_fails_the_engine_loudly_instead_of_hanging(tiny_llama):
    llm = RecordingLLM(hang=True)
    engine, loop = _engine(tiny_llama, llm, timeout_s=0.3)
    with pytest.raises(EngineFailedError, match="loading weight version 4 failed: TimeoutError"):
        loop.run_until_complete(engine.update_weights(4, _manifest(tiny_llama)))
    assert engine.version == 3 and ("pause_generation", (), {"mode": "abort"}) in llm.calls
    with pytest.raises(EngineFailedError):
        loop.run_until_complete(engine.update_weights(5, _manifest(tiny_llama, 5)))


def test_unknown_tensor_in_manifest_is_refused_without_pausing_but_its_broadcast_is_drained(tiny_llama):
    llm = RecordingLLM()
    engine, loop = _engine(tiny_llama, llm)
    extra = [("model.layers.9.mlp.nope.weight", torch.zeros(2, 2, dtype=torch.bfloat16))]
    with pytest.raises(WeightMismatchError, match=r"unknown tensor 'model\.layers\.9\.mlp\.nope\.weight'"):
        loop.run_until_complete(engine.update_weights(4, _manifest(tiny_llama, extra=extra)))
    # the learner and the other ranks wait in the broadcast until this rank took the bytes: drain, no pause
    assert [c[0] for c in llm.calls] == ["start_weight_update", "update_weights", "finish_weight_update"]
    assert llm.calls[1][1][0].update_info["drain"] is True and engine.version == 3


def test_worker_side_loads_only_after_every_checksum_passed(monkeypatch):
    import vllm.model_executor.model_loader.reload as reload

    events = []
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: events.append("init"))
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, cfg: events.append("finalize"))
    named = [("a", torch.randn(4, 4).to(torch.bfloat16)), ("b", torch.randn(3))]
    metas = tensor_metas(named)

    def engine_with(payload):
        it = iter(payload)
        group = SimpleNamespace(broadcast=lambda t, src, stream: t.copy_(next(it)))
        model = SimpleNamespace(load_weights=lambda ws: events.append(("load", [n for n, _ in ws])))
        return SimpleNamespace(model_update_group=group, device="cpu", model=model, model_config=None)
    info = SimpleNamespace(names=[m.name for m in metas], dtype_names=[m.dtype for m in metas],
                           shapes=[list(m.shape) for m in metas], checksums=[m.checksum for m in metas],
                           checksum_kind="wsum64-v1")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    assert load_broadcast_verified(engine_with([t for _, t in named]), info) == 2
    assert events == ["init", ("load", ["a", "b"]), "finalize"]
    events.clear()
    from gyre.proto.tensor_chunks import ChunkError
    with pytest.raises(ChunkError, match="'b': checksum"):
        load_broadcast_verified(engine_with([named[0][1], named[1][1] + 1]), info)
    assert events == []  # nothing loaded
    # drained (refused by the engine) or of an unknown checksum kind: every tensor received, nothing loaded
    engine = engine_with([t for _, t in named])
    assert load_broadcast_verified(engine, SimpleNamespace(**{**vars(info), "drain": True})) == 0
    with pytest.raises(StopIteration):
        engine.model_update_group.broadcast(torch.empty(1), 0, None)  # both tensors were taken
    engine = engine_with([t for _, t in named])
    with pytest.raises(ChunkError, match="checksum kind 'crc9', expected 'wsum64-v1'"):
        load_broadcast_verified(engine, SimpleNamespace(**{**vars(info), "checksum_kind": "crc9"}))
    with pytest.raises(StopIteration):
        engine.model_update_group.broadcast(torch.empty(1), 0, None)
    with pytest.raises(ChunkError, match=r"unknown dtype\(s\) \['int4'\]"):
        load_broadcast_verified(engine_with([]), SimpleNamespace(**{**vars(info), "dtype_names": ["int4", "float32"]}))
    assert events == []


def test_a_manifest_from_the_past_is_refused_but_its_broadcast_is_drained(tiny_llama):
    from gyre.rollout.engine import StaleVersionError

    llm = RecordingLLM()
    engine, loop = _engine(tiny_llama, llm)  # at version 3
    with pytest.raises(StaleVersionError, match=r"weight version \(2\) must be newer than the current one \(3\)"):
        loop.run_until_complete(engine.update_weights(2, _manifest(tiny_llama, version=2)))
    assert [c[0] for c in llm.calls] == ["start_weight_update", "update_weights", "finish_weight_update"]
    assert llm.calls[1][1][0].update_info["drain"] is True and engine.version == 3
