"""Asynchronous checkpoint save: DeepSpeed's state is captured in memory, then written in the background.

``engine.save_checkpoint`` normally ``torch.save``s every state dict while training waits. For an async
save ``learner.checkpoint.engine`` swaps in its ``SnapshotCheckpointEngine`` (a DeepSpeed ``CheckpointEngine``)
for the duration of that call: each ``save(state_dict, path)`` clones the state's tensors to CPU memory instead of writing
them, so the call returns after one memory copy (~1.9 GB for SmolLM2-135M with AdamW states: weights
bf16 + fp32 master + two moments). A single background thread then writes the captured files into the
checkpoint's temp dir and runs the usual commit (``learner.checkpoint.store.commit``: fsync, sha256
manifest, rename). Training continues meanwhile; the next step may overwrite parameters and optimizer
moments because the capture holds copies.

Any number of ranks saves in the background. Every rank captures its own shard (the capture runs DeepSpeed's
save, with its barriers, in the training thread, where every rank makes the same collective calls in the same
order) and writes it in its own writer thread. The commit needs to know that every rank's files are on disk,
but a ``torch.distributed`` barrier in a writer thread would race the training collectives on the same group.
So the ranks meet through the file system instead: a rank ``r > 0`` whose files are written drops a marker
``.shard_rank{r}.json`` into the checkpoint's temp dir (``mark_shard``: its files and their sizes, or the error
its write raised), and rank 0's writer, after writing its own files, waits for the markers of every other rank
(``wait_for_shards``, bounded by ``SHARD_WAIT_S``), checks the files they list, removes the markers and commits.
A rank that dies mid-write leaves no marker: rank 0 never commits, and the temp dir is ignored on resume (the
learner group is fail-stop anyway: the dead rank's next collective fails every rank).

This is the same idea as DeepSpeed's ``DecoupledCheckpointEngine`` and PyTorch DCP's ``async_save``
(stage to CPU, persist off the critical path), without a second process. No deepspeed import here
(the learner loop imports this module).
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from gyre.faults import fault_point
from gyre.utils.durable import fsync_path

SHARD_WAIT_S = 1800.0
"""How long rank 0's writer waits for the other ranks' shard markers (seconds): gloo's default collective
timeout, which bounds how far a rank may fall behind in a synchronous save too. A rank that has not written its
shard by then has died or hangs, and the save fails (``ShardWaitError``)."""
_MARKER = ".shard_rank{rank}.json"


class ShardWaitError(RuntimeError):
    """An asynchronous multi-rank save cannot commit: a rank's shard marker did not appear in time, reports a
    failed write, or lists a file that is missing or has another size. The message names the rank and the temp
    dir."""


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


def mark_shard(tmp: Path, rank: int, files: list[str | Path], error: BaseException | None = None) -> Path:
    """Tell rank 0 that this rank's part of the save in ``tmp`` is done: write ``tmp/.shard_rank{rank}.json``
    (``{"rank", "files": {relpath: bytes}}`` for ``files``, paths under ``tmp``; or ``{"rank", "error"}`` when the
    write raised ``error``) under a temp name, fsync'd, then renamed, so rank 0 never reads half a marker.
    Returns its path. Raises ``OSError`` when it cannot be written (rank 0 then times out waiting for it)."""
    tmp = Path(tmp)
    doc: dict[str, Any] = {"rank": rank}
    if error is not None:
        doc["error"] = f"{type(error).__name__}: {error}"
    else:
        doc["files"] = {Path(f).relative_to(tmp).as_posix(): os.path.getsize(f) for f in files}
    final = tmp / _MARKER.format(rank=rank)
    part = final.with_name(final.name + ".part")
    with open(part, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, final)
    fsync_path(tmp)
    return final


def clear_shard_mark(tmp: Path, rank: int) -> None:
    """Remove this rank's marker left in ``tmp`` by an earlier save of the same step that did not commit (rank 0's
    own write failed after this rank had marked), so rank 0 never takes a stale marker for this save's. Each
    rank calls it before its capture, whose barriers rank 0's writer can only pass after every rank did."""
    (Path(tmp) / _MARKER.format(rank=rank)).unlink(missing_ok=True)


def wait_for_shards(tmp: Path, world_size: int, timeout_s: float | None = None, poll_s: float = 0.05) -> None:
    """Rank 0's writer: block until ranks ``1 .. world_size - 1`` have each marked their shard in ``tmp``
    (``mark_shard``), check that every file a marker lists exists with its size, then remove the markers (so the
    committed checkpoint holds the same files as a synchronous save). Returns at once for ``world_size`` 1.
    Polls every ``poll_s`` seconds; ``timeout_s`` defaults to ``SHARD_WAIT_S`` (read at call time). No
    ``torch.distributed`` call: it runs in a writer thread while training collectives go on.

    Raises:
        ShardWaitError: a marker still missing after ``timeout_s`` seconds (naming the ranks), a rank's write
            failed (naming the rank and its error), or a listed file is missing or has another size.
    """
    tmp = Path(tmp)
    timeout_s = SHARD_WAIT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    markers = {r: tmp / _MARKER.format(rank=r) for r in range(1, world_size)}
    while missing := [r for r, m in markers.items() if not m.exists()]:
        if time.monotonic() >= deadline:
            raise ShardWaitError(f"checkpoint {tmp}: rank(s) {missing} did not finish writing their shard within "
                                 f"{timeout_s:g} s (died or hung); the checkpoint is not committed")
        time.sleep(poll_s)
    for rank, marker in markers.items():
        doc = json.loads(marker.read_text())
        if "error" in doc:
            raise ShardWaitError(f"checkpoint {tmp}: rank {rank} failed to write its shard: {doc['error']}")
        for rel, size in doc["files"].items():
            path = tmp / rel
            got = path.stat().st_size if path.is_file() else None
            if got != size:
                raise ShardWaitError(f"checkpoint {tmp}: rank {rank} wrote {rel} ({size} bytes) but it is "
                                     f"{'missing' if got is None else f'{got} bytes'}")
    for marker in markers.values():
        marker.unlink()


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
