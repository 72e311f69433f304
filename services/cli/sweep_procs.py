"""The processes of a sweep's run, found by a marker in their environment, so that what a killed attempt left
behind is stopped before the run is started again.

``gyre sweep`` starts each run with ``GYRE_SWEEP_RUN={run dir}`` in its environment. Every process of the run
inherits it: the driver, the private Ray it starts (GCS, raylet, workers), the service actors and vLLM's
engine-core process. When a driver dies abruptly its Ray dies with it within seconds, but not always all of it
(seen once: two processes of a run alive 60 s after its sweep was SIGKILLed). Before a run's next attempt, and after an attempt ends, the sweep SIGKILLs any process
still carrying that run's marker: processes the sweep itself started, which could otherwise hold memory or,
for a learner, still write the run's checkpoints while its successor resumes. Linux (``/proc``) only; elsewhere
nothing is found.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

RUN_MARKER = "GYRE_SWEEP_RUN"
"""Environment variable naming the run directory a process belongs to (set by ``gyre sweep``)."""


def marked_processes(run_dir: str | Path, proc: Path = Path("/proc")) -> list[int]:
    """Pids of live processes (other than this one) whose environment holds ``GYRE_SWEEP_RUN={run_dir}``."""
    needle = f"{RUN_MARKER}={run_dir}\0".encode()
    out = []
    for entry in proc.iterdir() if proc.is_dir() else []:
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                out.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return sorted(out)


def kill_leftovers(run_dir: str | Path, wait_s: float = 10.0) -> list[int]:
    """SIGKILL every process marked with ``run_dir`` and wait up to ``wait_s`` for them to go; returns their pids."""
    pids = marked_processes(run_dir)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + wait_s
    while pids and marked_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids
