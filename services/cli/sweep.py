"""``gyre sweep SWEEP.yaml``: run every cell of a sweep (``services.cli.sweep_config``) as its own ``gyre run``
process, ``parallel`` at a time, and ``gyre sweep status SWEEP.yaml``: what each run has done.

Every cell's recipe is loaded (``load_recipe`` with its overrides) before any run starts; a cell that does not
load is refused by index and overrides. Each run is ``python -m gyre.services.cli run BASE --set KEY=VALUE ...
--resume auto`` (through ``ray job submit`` with the ``ray-job`` backend), its output appended to
``{sweep dir}/logs/{name}.log``, so a run that crashes fails alone and the sweep goes on. Re-running the sweep
skips the runs that are done (from the runs' own files, ``services.cli.sweep_state``) and resumes the others
with ``--resume auto``. A run's driver dies with the sweep (``PR_SET_PDEATHSIG``); Ctrl-C / SIGTERM stop each
running driver with SIGINT (Ray shut down cleanly), the next start resumes it. Processes of a run that outlive
its driver are stopped before its next attempt and when an attempt ends (``services.cli.sweep_procs``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from gyre.services.cli.sweep_config import Cell, SweepConfig, SweepError, expand_cells, read_sweep
from gyre.services.cli.sweep_procs import RUN_MARKER, kill_leftovers
from gyre.services.cli.sweep_state import LOGS, SweepRecord, run_state
from gyre.services.control.recipe.schema import RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[2]
STOP_GRACE_S = 120.0
"""Seconds a driver gets to stop after SIGINT (checkpoint nothing, shut Ray down) before it is SIGKILLed."""
POLL_S = 1.0
RAY_CLI = str(Path(sys.executable).with_name("ray")) if Path(sys.executable).with_name("ray").is_file() else "ray"
"""The ``ray`` command of this Python's environment (the ray-job backend), else the one on ``PATH``."""


@dataclass(frozen=True)
class Plan:
    """A validated sweep: its cells, where their runs go and each cell's ``learner.num_steps``."""

    config: SweepConfig
    path: Path
    """The sweep file."""
    base: Path
    """The base recipe (absolute)."""
    sweep_dir: Path
    """``{run_dir}/{name}`` (absolute): the runs, ``sweep.json`` and ``logs/``."""
    cells: list[Cell]
    num_steps: dict[str, int]
    """Run name → its recipe's ``learner.num_steps``."""

    def overrides(self, cell: Cell) -> dict:
        """Everything a cell's run is given with ``--set``: ``set``, the cell's values, its name and run dir."""
        return {**self.config.set, **cell.overrides, "name": cell.name, "run_dir": str(self.sweep_dir)}

    def out_dir(self, cell: Cell) -> Path:
        return self.sweep_dir / cell.name

    def log(self, cell: Cell) -> Path:
        return self.sweep_dir / LOGS / f"{cell.name}.log"


def plan_sweep(path: str | Path, full: bool = True) -> Plan:
    """Read a sweep, expand its cells and load every cell's recipe.

    Args:
        full: load each recipe as ``gyre run`` will (model folder or Hub id, datasets); ``False``: check each
            one's keys and values only (``load_recipe(dry_run=True)``: nothing downloaded, no model read).

    Raises:
        SweepError: a bad sweep file, name template or base recipe, or a cell whose recipe does not load (the
            message names the cell's index and overrides, then the recipe's error).
    """
    config = read_sweep(path)
    base = Path(config.base).expanduser().resolve()
    if not base.is_file():
        raise SweepError(f"sweep {path}: base recipe {base} does not exist (a relative base resolves from the "
                         "current directory)")
    try:
        raw = yaml.safe_load(base.read_text())
    except yaml.YAMLError as exc:
        raise SweepError(f"sweep {path}: base recipe {base} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise SweepError(f"sweep {path}: base {config.base!r} is not a recipe file (expected a YAML mapping at {base})")
    try:
        cells = expand_cells(config, raw)
    except SweepError as exc:
        raise SweepError(f"sweep {path}: {exc}") from None
    plan = Plan(config, Path(path), base, Path(config.run_dir).expanduser().resolve() / config.name, cells, {})
    full = full and config.backend.type == "local"  # a cluster's model and data paths are the cluster's
    for cell in cells:
        try:
            recipe = load_recipe(base, plan.overrides(cell), dry_run=not full)
        except RecipeError as exc:
            raise SweepError(f"sweep {path}: cell {cell.index} ({cell.label()}, run {cell.name}): {exc}") from None
        plan.num_steps[cell.name] = recipe.learner.num_steps
    return plan


def _yaml_value(value) -> str:
    """``value`` as YAML text that ``gyre run --set`` reads back to the same value (``1.0e-05``, ``'null'``)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()
    return text.removesuffix("...").strip()


def run_command(plan: Plan, cell: Cell, submission_id: str | None = None) -> list[str]:
    """The argv of one attempt at a cell's run: ``gyre run`` here, or wrapped in ``ray job submit``."""
    sets = [arg for k, v in plan.overrides(cell).items() for arg in ("--set", f"{k}={_yaml_value(v)}")]
    backend = plan.config.backend
    if backend.type == "local":
        return [sys.executable, "-m", "gyre.services.cli", "run", str(plan.base), *sets, "--resume", "auto"]
    base = os.path.relpath(plan.base, Path(backend.working_dir).resolve())
    submit = [RAY_CLI, "job", "submit", *(["--address", backend.address] if backend.address else []),
              "--working-dir", backend.working_dir, *(["--submission-id", submission_id] if submission_id else [])]
    return [*submit, "--", "python", "-m", "gyre.services.cli", "run", base, *sets, "--set", "ray.address=auto",
            "--resume", "auto"]


def _die_with_parent(parent: int) -> None:
    """In the child, before exec: be SIGKILLed when the sweep dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so a
    killed sweep leaves no driver behind (each run has a process group of its own — ``ray.init`` would move the
    driver into one anyway — out of reach of a signal to the sweep's group; Ray's own processes die with their
    driver)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the sweep died before prctl
            os._exit(1)


class _Launcher:
    """Starts, watches and stops the runs' processes (the main thread only: ``PR_SET_PDEATHSIG`` follows the
    thread that forked)."""

    def __init__(self, plan: Plan, record: SweepRecord, console: Console) -> None:
        self.plan, self.record, self.console = plan, record, console
        self.running: dict[str, tuple[subprocess.Popen, Cell, str | None]] = {}

    def start(self, cell: Cell) -> None:
        log_path = self.plan.log(cell)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        remote = self.plan.config.backend.type == "ray-job"
        job = f"gyre-{self.plan.config.name}-{cell.name}-{int(time.time())}" if remote else None
        argv = run_command(self.plan, cell, job)
        attempt = len(self.record.attempts(cell.name)) + 1
        self._kill_leftovers(cell, "an earlier attempt")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               "GYRE_SWEEP": self.plan.config.name, RUN_MARKER: str(self.plan.out_dir(cell))}
        with log_path.open("a") as log:
            log.write(f"=== gyre sweep {self.plan.config.name}: attempt {attempt} at "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(argv)}\n")
            log.flush()
            parent = os.getpid()
            # a process group of its own: a Ctrl-C reaches the run once, forwarded by stop_all, not twice
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    process_group=0, preexec_fn=lambda: _die_with_parent(parent))
        self.record.begin(cell.name, argv, **({"submission_id": job} if job else {}))
        self.running[cell.name] = (proc, cell, job)
        self.console.print(f"[{cell.index}] {cell.name}: started (attempt {attempt}, pid {proc.pid}; log "
                           f"{log_path})", highlight=False, soft_wrap=True)

    def reap(self) -> list[tuple[Cell, int]]:
        """The runs that ended since the last call, with their exit status (recorded)."""
        ended = []
        for name, (proc, cell, _) in list(self.running.items()):
            code = proc.poll()
            if code is not None:
                del self.running[name]
                self._ended(cell, code)
                ended.append((cell, code))
        return ended

    def _kill_leftovers(self, cell: Cell, whose: str) -> None:
        """Stop the processes of ``cell``'s run that outlived their driver (``services.cli.sweep_procs``)."""
        pids = kill_leftovers(self.plan.out_dir(cell))
        if pids:
            self.console.print(f"[{cell.index}] {cell.name}: killed {len(pids)} process(es) left by {whose} "
                               f"(pids {', '.join(map(str, pids))})", highlight=False, soft_wrap=True)

    def _ended(self, cell: Cell, code: int, stopped: bool = False) -> None:
        self._kill_leftovers(cell, "its driver")
        with self.plan.log(cell).open("a") as log:
            log.write(f"=== gyre sweep: exit status {code}{' (stopped by the sweep)' if stopped else ''} at "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self.record.end(cell.name, code, stopped)

    def _stop_job(self, job: str) -> None:
        """``ray job stop JOB`` (the ray-job backend); a failure is printed, the sweep goes on stopping."""
        address = self.plan.config.backend.address
        try:
            done = subprocess.run([RAY_CLI, "job", "stop", *(["--address", address] if address else []), job],
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
            failed = done.returncode and (done.stderr or done.stdout).strip()[-300:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            failed = str(exc)
        if failed:
            self.console.print(f"ray job stop {job} failed: {failed}", highlight=False, soft_wrap=True)

    def stop_all(self) -> None:
        """SIGINT every running driver (``ray job stop`` for a job), wait ``STOP_GRACE_S``, SIGKILL the rest."""
        for proc, cell, job in self.running.values():
            self.console.print(f"[{cell.index}] {cell.name}: stopping", highlight=False)
            if job is not None:
                self._stop_job(job)
            proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + STOP_GRACE_S
        for name, (proc, cell, _) in list(self.running.items()):
            try:
                code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            self._ended(cell, code, stopped=True)
        self.running.clear()


def run_sweep(plan: Plan, console: Console) -> int:
    """Run every cell that is not done, ``parallel`` at a time; print the final table. Exit status: 0 when every
    run is done, 1 when some are not (failed, or driven by another process), 130 when stopped by a signal."""
    header = {"sweep": plan.config.name, "file": str(plan.path.resolve()), "base": str(plan.base),
              "backend": plan.config.backend.type, "parallel": plan.config.parallel}
    record = SweepRecord(plan.sweep_dir, header)
    pending: list[Cell] = []
    for cell in plan.cells:
        state = run_state(plan.out_dir(cell), plan.num_steps[cell.name])
        record.set_run(cell, plan.out_dir(cell), plan.log(cell), state)
        if state.state in ("done", "running"):
            console.print(f"[{cell.index}] {cell.name}: {state.text()}, skipped", highlight=False, soft_wrap=True)
        else:
            pending.append(cell)
    record.write()
    stop: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _: stop.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    launcher = _Launcher(plan, record, console)
    try:
        while (pending or launcher.running) and not stop:
            while pending and len(launcher.running) < plan.config.parallel and not stop:
                launcher.start(pending.pop(0))
            for cell, code in launcher.reap():
                state = run_state(plan.out_dir(cell), plan.num_steps[cell.name], code)
                record.set_run(cell, plan.out_dir(cell), plan.log(cell), state)
                console.print(f"[{cell.index}] {cell.name}: exit {code}, {state.text()}", highlight=False,
                              soft_wrap=True)
                record.write()
            time.sleep(POLL_S)
        if stop:
            console.print(f"{signal.Signals(stop[0]).name}: stopping {len(launcher.running)} run(s); "
                          "re-run the sweep to resume", highlight=False)
            launcher.stop_all()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        states = refresh(plan, record)
        record.write()
    print_status(plan, states, console)
    return 130 if stop else 0 if all(s.state == "done" for s in states.values()) else 1


def refresh(plan: Plan, record: SweepRecord) -> dict:
    """Every cell's state now (run files + the last attempt's exit status), also set in ``record``."""
    states = {}
    for cell in plan.cells:
        states[cell.name] = run_state(plan.out_dir(cell), plan.num_steps[cell.name], record.last_exit(cell.name))
        record.set_run(cell, plan.out_dir(cell), plan.log(cell), states[cell.name])
    return states


def print_status(plan: Plan, states: dict, console: Console) -> None:
    """The table ``gyre sweep status`` prints: cell, run, overrides, state, then a count per state."""
    table = Table(title=f"sweep {plan.config.name} ({plan.sweep_dir})", title_justify="left")
    for column in ("cell", "run", "overrides", "state"):
        table.add_column(column, overflow="fold")
    for cell in plan.cells:
        table.add_row(str(cell.index), cell.name, cell.label(), states[cell.name].text())
    console.print(table)
    counts: dict[str, int] = {}
    for state in states.values():
        counts[state.state] = counts.get(state.state, 0) + 1
    console.print(", ".join(f"{n} {s}" for s, n in counts.items()), highlight=False)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``gyre sweep [status] SWEEP.yaml [--dry-run]``."""
    p = sub.add_parser("sweep", usage="gyre sweep [--dry-run] SWEEP.yaml\n       gyre sweep status SWEEP.yaml", help="run a sweep of recipes (grid/zip of overrides × seeds), resumable; "
                                     "`gyre sweep status SWEEP.yaml` shows what each run has done",
                       description="gyre sweep SWEEP.yaml runs every cell not yet done (re-running resumes the "
                                   "others with --resume auto); gyre sweep status SWEEP.yaml prints each run's "
                                   "state from the runs' own files.")
    p.add_argument("target", nargs="+", metavar="[status] SWEEP.yaml",
                   help="the sweep file (YAML: base, set, grid, zip, seeds, run_name, parallel, backend; see "
                        "docs/guides/experiments.md), after `status` to print the runs' states")
    p.add_argument("--dry-run", action="store_true", help="validate every cell's recipe (keys and values only) "
                                                          "and list the cells; start nothing")


def main(args: argparse.Namespace, console: Console) -> int:
    """``gyre sweep``: 0 all done (or a status/dry run printed), 1 runs not done, 2 bad sweep, 130 stopped."""
    target = args.target
    status = len(target) == 2 and target[0] == "status"
    if len(target) != 1 and not status:
        console.print(f"[red]error:[/red] expected SWEEP.yaml or status SWEEP.yaml, got {' '.join(target)!r}",
                      highlight=False)
        return 2
    try:
        plan = plan_sweep(target[-1], full=not (status or args.dry_run))
    except SweepError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        return 2
    if status or args.dry_run:
        record = SweepRecord(plan.sweep_dir, {})
        print_status(plan, refresh(plan, record), console)
        return 0
    return run_sweep(plan, console)
