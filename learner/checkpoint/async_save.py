"""Asynchronous checkpoint save: DeepSpeed's state is captured in memory, then written in the background.

``engine.save_checkpoint`` normally ``torch.save``s every state dict while training waits. For an async
save ``learner.checkpoint.engine`` swaps in its ``SnapshotCheckpointEngine`` (a DeepSpeed ``CheckpointEngine``)
for the duration of that call: each ``save(state_dict, path)`` clones the state's tensors to CPU memory instead of writing
them, so the call returns after one memory copy (~1.9 GB for SmolLM2-135M with AdamW states: weights
bf16 + fp32 master + two moments). A single background thread then writes the captured files into the
checkpoint's temp dir and runs the usual commit (``learner.checkpoint.store.commit``: fsync, sha256
manifest, rename). Training continues meanwhile; the next step may overwrite parameters and optimizer
moments because the capture holds copies.

Only world size 1 saves in the background: with more ranks, the commit needs a barrier across ranks
that must not race the training collectives, so ``learner.checkpoint.engine`` saves synchronously there.

This is the same idea as DeepSpeed's ``DecoupledCheckpointEngine`` and PyTorch DCP's ``async_save``
(stage to CPU, persist off the critical path), without a second process. No deepspeed import here
(the learner loop imports this module).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from gyre.faults import fault_point


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` safe to write while training goes on: tensors are cloned (to CPU, contiguous;
    a view becomes a compact tensor as with ``clone_tensors_for_torch_save``), dicts/lists/tuples are
    rebuilt, everything else (numbers, strings, config objects DeepSpeed stores) is kept by reference."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True).contiguous()
    if isinstance(obj, dict):
        out = {k: snapshot(v) for k, v in obj.items()}
        if type(obj) is dict:
            return out
        try:
            return type(obj)(out)  # OrderedDict and friends
        except TypeError:
            return out
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(snapshot(v) for v in obj)
    return obj


def write_captured(captured: list[tuple[str, Any]]) -> int:
    """``torch.save`` each captured state to its path (DeepSpeed's own file format); returns bytes written.
    Fault point ``learner.ckpt.mid_write`` fires after the first file (crash tests)."""
    total = 0
    for i, (path, state) in enumerate(captured):
        torch.save(state, path)
        total += os.path.getsize(path)
        if i == 0:
            fault_point("learner.ckpt.mid_write")
    return total


def lower_thread_priority(nice: int = 19) -> None:
    """Make the calling thread yield the CPU to training (Linux: a thread has its own nice value, set
    through ``setpriority(PRIO_PROCESS, tid)``). Best effort: a platform without it keeps the default."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):  # not Linux, or not permitted: the save just competes for the CPU
        pass


class BackgroundSaver:
    """One background writer thread at the lowest CPU priority; at most one save in flight (``submit``
    waits for the previous one).

    ``submit(fn)`` returns a ``Future`` of ``fn()``; exceptions surface from ``Future.result``.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-ckpt-writer",
                                        initializer=lower_thread_priority)
        self._inflight: Future | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], Path]) -> Future:
        with self._lock:
            if self._inflight is not None:
                self._inflight.exception()  # wait; the owner of that future reports its outcome
            self._inflight = self._pool.submit(fn)
            return self._inflight

    def wait(self, timeout: float | None = None) -> None:
        """Block until the in-flight save (if any) finished (successfully or not)."""
        fut = self._inflight
        if fut is not None:
            fut.exception(timeout=timeout)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
