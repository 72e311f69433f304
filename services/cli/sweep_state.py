"""What a sweep's runs have done, read from the runs' own files, and the sweep's record ``sweep.json``.

A run's state comes from what ``gyre run`` leaves in its directory, the way ``gyre run --resume auto`` itself
decides (``services.control.orchestration.controller.prepare_run_dir``): **done** when ``summary.json`` records a final policy
version ``>= learner.num_steps``; otherwise **running** while a live driver on this host holds it
(``services.control.outputs.run_lock``'s holder record), **partial step N/M** (``N``: the highest training step in
``metrics.jsonl``), **not started** without a directory. ``sweep.json`` only adds what the runs cannot say
themselves: the exit status of each attempt the sweep launched, so a run whose last attempt exited non-zero and
that is not done shows as **failed**. Nothing here changes a run directory.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from gyre.services.cli.sweep_config import Cell

SWEEP_RECORD = "sweep.json"
"""The sweep's record, in the sweep directory beside its runs."""
LOGS = "logs"
"""Each run's driver output (all attempts, appended) is ``{sweep dir}/logs/{run name}.log``."""


@dataclass(frozen=True)
class RunState:
    """One run's state, as its files tell it."""

    state: str
    """``done``, ``running``, ``partial``, ``failed`` or ``not started``."""
    step: int
    """Highest training step in ``metrics.jsonl`` (the final policy version when done; 0 before any step)."""
    num_steps: int
    """The cell's ``learner.num_steps``."""
    detail: str = ""
    """The failed attempt's exit status, or the live driver's pid."""

    def text(self) -> str:
        """``done``, ``partial step 3/10``, ``failed (exit 1) at step 0/10``, ``running step 2/10 (pid 7)``, ...."""
        progress = f"step {self.step}/{self.num_steps}"
        if self.state == "done":
            return "done"
        if self.state == "not started":
            return "not started" + (f" ({self.detail})" if self.detail else "")
        if self.state == "failed":
            return f"failed ({self.detail}) at {progress}"
        return f"{self.state} {progress}" + (f" ({self.detail})" if self.detail else "")


def finished_version(out_dir: Path, num_steps: int) -> int | None:
    """The final policy version of a run that reached ``num_steps`` (its ``summary.json``), else ``None`` —
    ``services.control.orchestration.controller.prepare_run_dir``'s test for "already finished"."""
    try:
        summary = json.loads((Path(out_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    version = summary.get("final_version", -1) if isinstance(summary, dict) else -1
    return version if isinstance(version, int) and version >= num_steps else None


def last_trained_step(out_dir: Path) -> int:
    """The highest ``step`` of a training row (one with ``loss``) in ``metrics.jsonl``; 0 when there is none. A
    line that is not JSON (a driver killed mid-write) is skipped."""
    best = 0
    try:
        lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "loss" in row and isinstance(row.get("step"), int):
            best = max(best, row["step"])
    return best


def live_driver(out_dir: Path) -> int | None:
    """The pid of a live ``gyre run`` driver of this run on this host (``run_lock``'s holder record), else
    ``None``. A record left by a driver that was killed (``kill -9``) names a pid that is gone."""
    record = Path(out_dir).with_name(f".{Path(out_dir).name}.driver.json")
    try:
        info = json.loads(record.read_text())
        pid, host = int(info["pid"]), info["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname():
        return None  # another host's driver cannot be checked from here; its own lock still arbitrates
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    try:  # a driver killed a moment ago can be a zombie until it is reaped: dead all the same
        zombie = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        zombie = False
    return None if zombie else pid


def run_state(out_dir: Path, num_steps: int, last_exit: int | None = None) -> RunState:
    """The state of the run in ``out_dir`` (see the module docstring). ``last_exit``: the exit status of the
    sweep's last attempt at it (``None``: none recorded, or interrupted before it ended)."""
    out_dir = Path(out_dir)
    final = finished_version(out_dir, num_steps)
    if final is not None:
        return RunState("done", final, num_steps)
    step = last_trained_step(out_dir)
    pid = live_driver(out_dir)
    if pid is not None:
        return RunState("running", step, num_steps, f"pid {pid}")
    if last_exit not in (None, 0):
        return RunState("failed", step, num_steps, f"exit {last_exit}")
    if not out_dir.exists():
        return RunState("not started", step, num_steps)
    return RunState("partial", step, num_steps)


class SweepRecord:
    """``{sweep dir}/sweep.json``: the sweep's cells (index, name, overrides, run dir, log), each one's state when
    last written and every attempt the sweep launched (start and end time, exit status, command). Attempts of
    earlier invocations are kept for the cells that still exist. Written atomically (temp file + rename)."""

    def __init__(self, sweep_dir: Path, header: dict) -> None:
        self.path = Path(sweep_dir) / SWEEP_RECORD
        old = self.read(sweep_dir)
        self._attempts: dict[str, list[dict]] = {r["name"]: r.get("attempts", []) for r in old.get("runs", [])}
        self.header = header
        self.runs: dict[str, dict] = {}

    @staticmethod
    def read(sweep_dir: Path) -> dict:
        """The record in ``sweep_dir`` (``{}`` when there is none or it cannot be read)."""
        try:
            data = json.loads((Path(sweep_dir) / SWEEP_RECORD).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def last_exit(self, name: str) -> int | None:
        """The exit status of the last attempt at ``name`` (``None``: no attempt, it never ended — the sweep was
        killed — or the sweep stopped it on a signal: interrupted, not failed)."""
        last = (self._attempts.get(name) or [{}])[-1]
        return None if last.get("stopped") else last.get("exit_code")

    def attempts(self, name: str) -> list[dict]:
        return self._attempts.setdefault(name, [])

    def set_run(self, cell: Cell, out_dir: Path, log: Path, state: RunState) -> None:
        self.runs[cell.name] = {"index": cell.index, "name": cell.name, "overrides": cell.overrides,
                                "dir": str(out_dir), "log": str(log), "state": state.state,
                                "step": state.step, "num_steps": state.num_steps, "status": state.text()}

    def begin(self, name: str, command: list[str], **extra) -> None:
        self.attempts(name).append({"started": time.time(), "ended": None, "exit_code": None,
                                    "command": command, **extra})
        self.write()

    def end(self, name: str, exit_code: int, stopped: bool = False) -> None:
        """The last attempt at ``name`` ended; ``stopped``: because the sweep stopped it (SIGINT/SIGTERM)."""
        self.attempts(name)[-1].update(ended=time.time(), exit_code=exit_code, **({"stopped": True} if stopped else {}))

    def write(self) -> None:
        runs = [{**r, "attempts": self._attempts.get(n, [])} for n, r in self.runs.items()]
        data = {**self.header, "updated": time.time(), "runs": runs}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{SWEEP_RECORD}.tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str))
        os.replace(tmp, self.path)
