"""Randomized soak: ``python -m bench.soak [--minutes N] [--quick] [--seed S]``. The last line printed is one
JSON object.

A tiny-model run (the 2-layer random Llama of ``tests.tiny_model``; real vLLM, DeepSpeed, gRPC, a local Ray)
trains under the controller while a chaos process (joined to the run's Ray cluster like ``gyre scale``), for
``--minutes`` minutes (or until the run is two steps from its end, whichever comes first):

- churns the rollout fleet through ``services.control.commands.ops.scale``: 1 → ``--max-rollouts`` (default 4) at 10% of the
  window, back to 1 once all of them run and 60% of the window passed (after the window, if they start later);
- SIGKILLs a random live service (replay, the learner, or a running rollout), then waits until it recovered
  before the next kill (a random 5-20 s later).

Recovery of one kill (seconds from the SIGKILL): ``healthy_s`` until the supervisor's status shows the service
with a new pid and one more restart; ``next_step_s`` until the learner published a policy version above the
highest seen before the kill (training is moving again).

A *stall* is a gap between two consecutive new learner policy versions longer than ``--stall-s`` seconds
(default 30: on two loaded CPU cores a tiny-model step takes 1-3 s, a learner restart — Ray worker, DeepSpeed
init, resume from the newest checkpoint — about 7 s, a rollout restart — a vLLM engine start — 25-50 s).
The run's step count is ``--steps-per-minute × --minutes`` (at least 10), so the run usually outlasts the
chaos; the JSON reports the steps actually trained and the wall time.

JSON keys: ``kills`` (count) and ``kills_by_service``, ``restarts`` (per service, from the status),
``fleet_sizes_seen``, ``stalls`` (count), ``stall_threshold_s``, ``longest_gap_s``, ``recovery_s`` (service →
list of ``{healthy_s, next_step_s}``), ``steps``, ``wall_s``, ``chaos_s``, ``invariants`` (the checker's
``ok``/``counts``/violations, or ``{"available": false}`` without ``services.cli.invariants``), ``chaos_error``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gyre.services.control.commands import ops

REPO = Path(__file__).resolve().parents[1]


class Chaos:
    """Scales the rollout fleet and SIGKILLs one random service at a time, measuring recovery. Runs in its own
    process (``--chaos-child``), joined to the run's Ray cluster like ``gyre scale``: the driver shuts Ray down
    when the run ends, which would end a thread of its own that still talked to Ray. Everything it saw is
    rewritten to ``out`` (JSON) after each event; ``error`` holds what stopped it early."""

    def __init__(self, out: Path, minutes: float, steps: int, max_rollouts: int, rng: random.Random) -> None:
        self.out, self.window_s = out, minutes * 60
        self.steps, self.max_rollouts, self.rng = steps, max_rollouts, rng
        self.kills: list[dict] = []
        self.step_times: list[tuple[float, int]] = []
        """(monotonic time, version) whenever the learner's version first exceeded the highest seen."""
        self.fleet_sizes: list[int] = []
        self.restarts: dict[str, int] = {}
        self.chaos_s = 0.0
        self.error: str | None = None
        self._top = -1

    # ---- observation ----------------------------------------------------------------------------
    def status(self) -> dict:
        st = ops.status(self.state)
        version = st.get("learner_version") if st else None
        if version is not None and version > self._top:
            self._top = version
            if version >= 1:  # gaps are counted from the first trained step, not from the engines' start
                self.step_times.append((time.monotonic(), version))
        if st:
            running = sum(s["role"] == "rollout" and not s.get("starting") for s in st["services"])
            if not self.fleet_sizes or self.fleet_sizes[-1] != running:
                self.fleet_sizes.append(running)
            for name, n in st["restarts"].items():
                self.restarts[name] = max(n, self.restarts.get(name, 0))
        return st

    def wait(self, pred, what: str, timeout_s: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.status()
            if st and pred(st):
                return st
            time.sleep(0.25)
        raise TimeoutError(f"chaos: {what} not seen within {timeout_s} s")

    def near_end(self) -> bool:
        return self._top >= self.steps - 2

    # ---- chaos ----------------------------------------------------------------------------------
    def run(self, run_dir: Path, run: str, namespace: str) -> None:
        try:
            self._connect(run_dir, run, namespace)
            self._chaos()
        except Exception as exc:  # reported in the JSON line; the run itself goes on
            self.error = f"{type(exc).__name__}: {exc}"
        self.save()

    def _connect(self, run_dir: Path, run: str, namespace: str) -> None:
        deadline = time.monotonic() + 600
        while True:
            address = run_dir / run / "ray_address"
            try:
                if address.is_file():
                    self.state = ops.connect(run, namespace, address.read_text().strip())
                    break
            except ops.OpsError:  # the controller has not created its state actor yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run} never published its controller state in {run_dir}")
            time.sleep(0.5)
        self.wait(lambda s: (s["learner_version"] or 0) >= 1, "training underway", 600)

    def _chaos(self) -> None:
        t0 = time.monotonic()
        elapsed = lambda: time.monotonic() - t0  # noqa: E731
        scaled = False
        while elapsed() < self.window_s and not self.near_end():
            if not scaled and elapsed() >= 0.1 * self.window_s:
                ops.scale(self.state, "rollout", self.max_rollouts)
                scaled = True
            self._kill_one()
            pause = time.monotonic() + self.rng.uniform(5, 20)
            while time.monotonic() < pause and not self.near_end():
                self.status()
                time.sleep(0.25)
            if scaled and self.fleet_sizes[-1] == self.max_rollouts and elapsed() >= 0.6 * self.window_s:
                break
        self.chaos_s = elapsed()
        if scaled:  # the whole churn: the fleet reaches its peak (even after the window), then goes back to 1
            self.wait(lambda s: self.fleet_sizes[-1] == self.max_rollouts or self.near_end(),
                      f"{self.max_rollouts} rollouts running")
            ops.scale(self.state, "rollout", 1)
            self.wait(lambda s: self.fleet_sizes[-1] == 1 or self.near_end(), "1 rollout running")
        while not self.near_end():  # keep observing steps (stalls) until the end is near
            self.status()
            time.sleep(0.25)

    def _kill_one(self) -> None:
        st = self.status()
        live = [s for s in st["services"] if s["pid"] and not s.get("starting")]
        victim = self.rng.choice(live)
        name, pid, before = victim["name"], victim["pid"], st["restarts"].get(victim["name"], 0)
        top, t_kill = self._top, time.monotonic()
        os.kill(pid, signal.SIGKILL)
        kill = {"service": name, "pid": pid, "at_version": top}
        self.kills.append(kill)
        healthy = self.wait(lambda s: s["restarts"].get(name, 0) > before and any(
            x["name"] == name and x["pid"] not in (None, pid) for x in s["services"]), f"{name} restarted")
        kill["healthy_s"] = round(time.monotonic() - t_kill, 1)
        del healthy
        if not self.near_end():
            self.wait(lambda s: self._top > top, f"a learner step after {name} was killed")
            kill["next_step_s"] = round(time.monotonic() - t_kill, 1)
        self.save()

    def save(self) -> None:
        """Write what was seen so far to ``self.out`` (temp file + rename: a reader never sees half of it)."""
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"kills": self.kills, "step_times": self.step_times,
                                   "fleet_sizes": self.fleet_sizes, "restarts": self.restarts,
                                   "chaos_s": round(self.chaos_s, 1), "error": self.error}))
        tmp.replace(self.out)



def stalls(step_times: list, threshold_s: float) -> tuple[int, float]:
    """``(gaps longer than threshold_s, longest gap)`` between consecutive new learner versions (seconds)."""
    gaps = [b[0] - a[0] for a, b in zip(step_times, step_times[1:])]
    return sum(g > threshold_s for g in gaps), round(max(gaps, default=0.0), 1)


def recovery(kills: list[dict]) -> dict[str, list[dict]]:
    """Service → ``{healthy_s, next_step_s}`` of each of its kills, in order."""
    out: dict[str, list[dict]] = {}
    for k in kills:
        out.setdefault(k["service"], []).append({"healthy_s": k.get("healthy_s"), "next_step_s": k.get("next_step_s")})
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="chaos window in minutes (default 10)")
    p.add_argument("--quick", action="store_true", help="a 2-3 minute soak: --minutes 2")
    p.add_argument("--steps-per-minute", type=float, default=40.0,
                   help="learner steps per minute of chaos window (the run's num_steps; default 40)")
    p.add_argument("--max-rollouts", type=int, default=4, help="fleet size at the peak of the churn (default 4)")
    p.add_argument("--stall-s", type=float, default=30.0, help="a gap between learner steps above this is a stall")
    p.add_argument("--seed", type=int, default=0, help="seed of the chaos (victims, pauses)")
    p.add_argument("--run-dir", default=None, help="where the run goes (default: a temporary directory)")
    p.add_argument("--chaos-child", nargs=2, metavar=("RUN_DIR", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.minutes = 2.0
    for name in ("minutes", "steps_per_minute", "stall_s"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be > 0")
    if args.max_rollouts < 2:
        p.error(f"--max-rollouts ({args.max_rollouts}) must be >= 2 for the fleet to churn")
    return args


def chaos_child(args: argparse.Namespace) -> None:
    """The chaos process: joins the run ``soak`` under ``RUN_DIR`` and writes ``RUN_DIR/chaos.json``."""
    run_dir, steps = Path(args.chaos_child[0]), int(args.chaos_child[1])
    chaos = Chaos(run_dir / "chaos.json", args.minutes, steps, args.max_rollouts, random.Random(args.seed))
    chaos.run(run_dir, "soak", "gyre")


def soak(args: argparse.Namespace) -> dict:
    """Run the soak described in the module docstring; returns the JSON-able result."""
    from rich.console import Console

    from gyre.services.control.orchestration import controller
    from gyre.services.control.recipe.schema import load_recipe
    from tests.tiny_model import build_tiny_llama

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="gyre-soak-")).resolve()
    model = build_tiny_llama(run_dir / "tiny-llama")
    steps = max(10, round(args.minutes * args.steps_per_minute))
    recipe = load_recipe(REPO / "deploy/recipes/tiny-test.yaml", {
        "model": str(model), "run_dir": str(run_dir), "ray.num_cpus": 2, "name": "soak", "ray.namespace": "gyre",
        "eval_before": False, "eval_after": False, "learner.num_steps": steps, "learner.save_interval": 1,
        "replay.lease_ttl_s": 300, "replay.prompt_lease_ttl_s": 20, "rollout.spool_dir": str(run_dir / "spool")})
    child = subprocess.Popen([sys.executable, "-m", "bench.soak", "--chaos-child", str(run_dir), str(steps),
                              "--minutes", str(args.minutes), "--max-rollouts", str(args.max_rollouts),
                              "--seed", str(args.seed)], cwd=REPO, stdout=sys.stderr,
                             # the driver's local head turns Ray's token auth on (token in ~/.ray/auth_token)
                             env={**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")})
    t0 = time.monotonic()
    try:
        summary = controller.run(recipe, Console(stderr=True))
    finally:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    seen = json.loads((run_dir / "chaos.json").read_text()) if (run_dir / "chaos.json").is_file() else {}
    kills = seen.get("kills", [])
    n_stalls, longest = stalls(seen.get("step_times", []), args.stall_s)
    by_service: dict[str, int] = {}
    for k in kills:
        by_service[k["service"]] = by_service.get(k["service"], 0) + 1
    return {"kills": len(kills), "kills_by_service": by_service, "restarts": seen.get("restarts"),
            "fleet_sizes_seen": seen.get("fleet_sizes"), "stalls": n_stalls, "stall_threshold_s": args.stall_s,
            "longest_gap_s": longest, "recovery_s": recovery(kills), "steps": summary["final_version"],
            "num_steps": steps, "wall_s": round(time.monotonic() - t0, 1), "chaos_s": seen.get("chaos_s"),
            "invariants": invariants(recipe.out_dir), "training": trained(recipe.out_dir, model),
            "chaos_error": seen.get("error", "no chaos.json written"),
            "run_dir": str(recipe.out_dir)}


def trained(out: Path, model: Path) -> dict:
    """Whether the run trained: learner steps with ``grad_norm > 0`` and final-policy tensors that moved from
    the initial model (``tests.training.training_summary``, without its name lists)."""
    from tests.training import training_summary

    summary = training_summary(out, model)
    return {k: summary[k] for k in ("steps", "steps_with_grad", "tensors", "tensors_moved")}


def invariants(out: Path) -> dict:
    """``services.cli.invariants.check_run`` as plain values, or ``{"available": False}`` while it does not exist."""
    try:
        from gyre.services.cli.invariants import check_run
    except ModuleNotFoundError as exc:
        if exc.name != "gyre.services.cli.invariants":
            raise
        return {"available": False}
    report = check_run(out)
    return {"ok": report.ok, "counts": report.counts, "violations": [str(v) for v in report.violations]}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.chaos_child:
        chaos_child(args)
    else:
        print(json.dumps(soak(args)))


if __name__ == "__main__":
    main()
