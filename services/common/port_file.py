"""A server process's bound port, handed to the process that started it: the server binds port 0 (the OS
picks a free port and it stays bound) and writes the port it got to a file (``write``); the starter waits for
that file (``wait``). Nothing picks a port ahead and releases it for the server to bind later, when another
process may have taken it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Protocol


class _Process(Protocol):
    def poll(self) -> int | None: ...


def write(path: str | Path, port: int) -> None:
    """Write ``port`` to ``path`` atomically (a temp file renamed over it): a reader sees all of it or nothing."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


def wait(path: str | Path, proc: _Process, timeout_s: float = 60.0, poll_s: float = 0.05) -> int:
    """The port ``proc`` (a ``subprocess.Popen``) wrote to ``path``, once it is there. Delete a stale ``path``
    before starting ``proc``.

    Raises:
        RuntimeError: ``proc`` exited before writing it (the message has the exit code).
        TimeoutError: not written within ``timeout_s`` seconds.
    """
    path, deadline = Path(path), time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"server process exited with {proc.poll()} before writing its port to {path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no port in {path} after {timeout_s} s")
        time.sleep(poll_s)
    return int(path.read_text())
