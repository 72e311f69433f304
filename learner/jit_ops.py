"""DeepSpeed's JIT-built ops, loaded so that a learner killed while loading one cannot hang every later learner.

On the CPU accelerator ``deepspeed.initialize`` loads its shared-memory comm op (``deepspeed_shm_comm``) through
torch's ``cpp_extension.load``, which guards the build folder with a bare ``lock`` file: the loader creates it,
builds or checks the op, and deletes it. A process killed in between (a supervisor's SIGKILL, a crash test, Ctrl-C
during start-up) leaves the file behind, and every later process waits on it forever
(``torch.utils.file_baton.FileBaton.wait``: no owner, no timeout) — a learner that never starts, with nothing
logged. ``load_comm_op`` loads the op before ``deepspeed.initialize`` does, under a ``filelock`` lock (``flock``:
the kernel releases it when its holder dies). Holding it, no other gyre process is between torch's create and
delete, so a ``lock`` file found then is a dead process's and is removed. DeepSpeed caches the loaded op
(``OpBuilder._loaded_ops``), so ``deepspeed.initialize`` does not load it again.

A process outside gyre that builds into the same ``TORCH_EXTENSIONS_DIR`` at that moment is not covered: give
gyre its own (the Makefile sets ``.cache/torch_extensions``).

The build runs with the interpreter's own ``bin`` folder first on ``PATH`` (``ninja_first``): torch runs the first
``ninja`` on ``PATH``, and ninja 1.11 (Debian's ``/usr/bin/ninja``) and 1.13 (the lock's, in the venv) record a
different hash of the same command in ``.ninja_log``, so a process that found one after a process that found the
other rebuilt the op from scratch (~25–50 s of both cores). Which one a process found depended on how it was
started (``make test`` does not put the venv on ``PATH``; Ray workers and the cluster tests do): in the test suite
learners alternated, and every learner incarnation of a crash test recompiled the op.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import structlog
from filelock import FileLock

log = structlog.get_logger("learner")

FLOCK_NAME = ".gyre-jit-ops.flock"
"""The ``filelock`` file beside the op build folders (in the extensions root)."""


def _comm_op_builder():
    """DeepSpeed's shared-memory comm op builder for this accelerator, or ``None`` (none, or not compatible)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return builder


def build_dir(name: str) -> Path:
    """The folder torch JIT-builds op ``name`` in (``$TORCH_EXTENSIONS_DIR/name``, else torch's default root)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


@contextlib.contextmanager
def ninja_first():
    """Within the block, ``PATH`` starts with the interpreter's ``bin`` folder when a ``ninja`` is there (the lock's
    ``ninja`` package installs one), so every gyre process builds with the same ninja; restored after."""
    own = Path(sys.executable).parent
    before = os.environ.get("PATH")
    if (own / "ninja").is_file():
        os.environ["PATH"] = os.pathsep.join([str(own), *(before or "").split(os.pathsep)])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def load_comm_op(builder=None) -> object | None:
    """Load DeepSpeed's comm op (``builder``: its op builder; default: the accelerator's) under an flock, first
    removing a ``lock`` file a killed process left in its build folder. Returns the loaded module, or ``None``
    when this accelerator has no such op. Raises what the build raises (a compiler error names the op)."""
    builder = _comm_op_builder() if builder is None else builder
    if builder is None:
        return None
    folder = build_dir(builder.name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.parent / FLOCK_NAME)):
        stale = folder / "lock"
        if stale.exists():
            log.warning("stale_jit_lock_removed", op=builder.name, path=str(stale),
                        why="left by a process killed while loading the op; every later load would wait forever")
            stale.unlink()
        with ninja_first():
            return builder.load()
