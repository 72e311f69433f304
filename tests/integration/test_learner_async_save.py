"""Async checkpoint save (``learner.async_save``) on the tiny Llama with real DeepSpeed (ZeRO-2, CPU/gloo).

The background save must capture the state of the step it was taken at, even though training goes
on and rewrites parameters and optimizer moments while the files are written; it must produce the
same files as a synchronous save of that state, and resuming from it must continue bit-identically.
The overlap is forced, not hoped for: the background writer (``learner.checkpoint.engine.write_captured``,
wrapped by the test) waits for an event the test sets only after the next training step returned, so
the step runs while the save is in flight on every run.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from gyre.learner.checkpoint import store as ckpt
from gyre.learner.checkpoint.async_save import BackgroundSaver
from gyre.learner.batch import build_train_batch
from gyre.learner.checkpoint.request import CheckpointRequest
from tests.integration.test_learner_engine import ALGO, _engine, _table


def _step(engine, seed: int) -> None:
    engine.train_step(build_train_batch(_table(seed=seed), 0, engine.version, ALGO))


def _weights(engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.named_weights(dtype=None)}


def _manifest_files(path) -> dict[str, dict]:
    import json

    return json.loads((path / ckpt.MANIFEST).read_text())["files"]


def test_async_save_holds_its_step_while_training_continues(tiny_llama, tmp_path, monkeypatch):
    import gyre.learner.checkpoint.engine as ckpt_engine

    engine = _engine(tiny_llama, dtype="fp32")
    _step(engine, 0)
    at_step1 = _weights(engine)
    sync_path = engine.save_checkpoint(CheckpointRequest(tmp_path / "sync", pending_lease_ids=["a"], fingerprint="fp"))
    stepped, trainer, write_captured = threading.Event(), threading.get_ident(), ckpt_engine.write_captured

    def write_after_the_next_step(captured):
        assert threading.get_ident() != trainer, "the save wrote its files in the training thread (not async)"
        assert stepped.wait(300), "the next training step did not finish within 300 s of the save"
        return write_captured(captured)

    monkeypatch.setattr(ckpt_engine, "write_captured", write_after_the_next_step)
    saver = BackgroundSaver()
    future = engine.save_checkpoint(CheckpointRequest(tmp_path / "async", pending_lease_ids=["a"], fingerprint="fp",
                                                     saver=saver))
    assert isinstance(future, Future)
    _step(engine, 1)  # rewrites params and Adam moments while the save is in flight (its writer waits for this)
    assert not future.done() and not (tmp_path / "async" / "global_step_1").exists()
    stepped.set()
    at_step2 = _weights(engine)
    assert not all(torch.equal(at_step1[n], at_step2[n]) for n in at_step1)
    path = future.result(timeout=300)
    assert path == tmp_path / "async" / "global_step_1"
    meta = ckpt.verify(path)
    assert (meta.step, meta.policy_version, meta.pending_lease_ids) == (1, 1, ["a"])

    # Same files as the synchronous save of the same state; DeepSpeed's tensors byte-identical.
    sync_files, async_files = _manifest_files(sync_path), _manifest_files(path)
    assert sync_files.keys() == async_files.keys()
    for name in sync_files:
        if name.startswith("deepspeed/") and name.endswith(".pt"):
            a = torch.load(sync_path / name, weights_only=False)
            b = torch.load(path / name, weights_only=False)
            assert _tensors(a).keys() == _tensors(b).keys()
            assert all(torch.equal(x, _tensors(b)[k]) for k, x in _tensors(a).items()), name

    # Resume from the async checkpoint: step-1 weights, and the next step reproduces step 2 exactly.
    engine.load_checkpoint(path, fingerprint="fp")
    assert (engine.step, engine.version) == (1, 1)
    assert all(torch.equal(t, at_step1[n]) for n, t in engine.named_weights(dtype=None))
    _step(engine, 1)
    assert all(torch.equal(t, at_step2[n]) for n, t in engine.named_weights(dtype=None))
    saver.shutdown()


def test_a_failed_background_write_surfaces_from_the_future(tiny_llama, tmp_path, monkeypatch):
    import gyre.learner.checkpoint.async_save as async_save

    engine = _engine(tiny_llama)
    _step(engine, 0)
    saver = BackgroundSaver()
    root = tmp_path / "ckpt"
    engine.save_checkpoint(CheckpointRequest(root, saver=saver)).result(timeout=300)
    _step(engine, 1)

    def disk_full(obj, path):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(async_save.torch, "save", disk_full)
    exc = engine.save_checkpoint(CheckpointRequest(root, saver=saver)).exception(timeout=300)
    assert isinstance(exc, OSError) and exc.errno == 28
    assert ckpt.find_latest_verified(root) == root / "global_step_1"
    saver.shutdown()


def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested state, by its key path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out |= _tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out |= _tensors(v, f"{prefix}/{i}")
    return out
