"""One driver per run directory: ``gyre run`` holds a ``filelock`` on ``{run_dir}/.{name}.lock`` for its whole
life, so a second driver of the same run is refused (naming the pid that holds it) instead of writing the same
``metrics.jsonl``, journals and checkpoints.

The lock is an OS file lock (``fcntl.flock`` through ``filelock.FileLock``), so it is released when its process
exits, however it dies: a driver killed with ``kill -9`` never leaves a stale lock. It lives beside the run
directory, not inside it, because ``--resume none`` moves the directory aside. The holder's pid, host and start
time are written to ``{run_dir}/.{name}.driver.json`` for the refusal message; that file is informational only.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout


class RunDirBusyError(RuntimeError):
    """Another live process drives this run; the message names its pid, host and the lock file."""


def lock_paths(out_dir: Path) -> tuple[Path, Path]:
    """``(lock file, holder record)`` of the run directory ``out_dir`` (``{run_dir}/{name}``)."""
    return out_dir.with_name(f".{out_dir.name}.lock"), out_dir.with_name(f".{out_dir.name}.driver.json")


def _holder(record: Path) -> str:
    try:
        info = json.loads(record.read_text())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["started"])))
        return f"pid {int(info['pid'])} on {info['host']} (since {started})"
    except (OSError, ValueError, KeyError, TypeError):  # written by a holder that has not finished writing it
        return "another process"


@contextmanager
def hold_run_dir(out_dir: Path) -> Iterator[Path]:
    """Hold the run directory's driver lock for the ``with`` block; yields the lock file's path.

    Raises:
        RunDirBusyError: another process holds it now (checked once, without waiting).
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_file, record = lock_paths(out_dir)
    lock = FileLock(lock_file, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise RunDirBusyError(
            f"run directory {out_dir} is in use by {_holder(record)}: one driver per run (lock {lock_file}). "
            f"Stop that driver, or operate the live run with `gyre status/scale/restart`.") from None
    try:
        record.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
        yield lock_file
    finally:
        record.unlink(missing_ok=True)
        lock.release()
