"""Fleet benchmark: ``python -m bench.fleet --rollouts N [--shards K]``. The last line printed is one JSON object.

The whole control plane at fleet size N on this machine: the real controller and supervisor (local Ray), replay in K
shards (durable, one process each), the DeepSpeed learner on a tiny random Llama (``tests.tiny_model``) and the
gRPC weight path, with N rollouts on the simulated engine (``rollout.sim_engine``: each group "generates" for
``--group-s`` seconds, taking no CPU). The rollouts are hosted many to a process
(``placement.rollout.rollouts_per_process``, ``services.rollout.host``): each one its own identity with its own
replay connection, prompt leases, weight subscription and journal, so N = 256 fits two cores.

Mid-run (once the learner passed half its steps, or ``--kill-at-step``) the bench SIGKILLs host processes holding at
least 10% of the fleet and the process of one replay shard (``replay-shard-1``); the supervisor restarts them. Afterwards ``gyre check``
(``services.cli.invariants``) reads the run directory.

Figures (one JSON line): ``tick_p99_s`` / ``tick_max_s`` (the supervisor's ticks, the whole run: restarts included),
``insert_p99_s`` and ``lease_p99_s`` (replay's server-side latency, the worst shard, last 4096 requests each),
``ingest_groups_per_s`` and ``ingest_mb_per_s`` (groups accepted and WAL bytes over the training window),
``stale_drop_fraction`` (rows the staleness gate dropped / rows inserted), ``learner_idle_fraction`` (the learner's
wait for batches / its step time, steps after the first), ``rss_mb_per_rollout`` (resident memory of the host
processes / rollouts, before the kills), the machine's ceiling (``load_avg_1m`` against ``cpu_cores``, and
``weights_mb_per_version``: N × the model's bytes, which the learner sends and the rollouts check per version), and
under ``chaos``: what was killed, ``restarts`` (each killed service's restarts in the run's summary),
``restored_s`` (kill to every killed service back, as the status showed it; ``null`` when the run finished first:
the surviving shard and rollouts can carry the last steps alone), ``stall_s`` (the longest interval
between learner steps from the kills on) against ``version_interval_s`` (the median interval before them), and the
check's verdict (``lost_groups``, ``duplicates_trained``). With ``--baseline-rollouts B`` (default 4; 0: none) the
same run at B rollouts, without kills, comes first, and ``insert_p99_ratio`` = this run's insert p99 / the baseline's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from bench.run_watch import RunWatcher, beside_run
from bench.workdir import run_quietly
from gyre.services.control.outputs.report import read_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "deploy/recipes/tiny-test.yaml"
KILL_FRACTION = 0.1
"""Share of the fleet whose processes are SIGKILLed mid-run (rounded up to whole host processes)."""


def log(msg: str) -> None:
    print(f"[bench.fleet] {msg}", file=sys.stderr, flush=True)


# ---- pure logic --------------------------------------------------------------------------------------------
def per_process(rollouts: int) -> int:
    """Rollouts per host process: 16 processes at most, and at least 2 rollouts each (N=16: 8 processes of 2)."""
    return max(2, math.ceil(rollouts / 16))


def hosts_to_kill(rollouts: int, per: int, fraction: float = KILL_FRACTION) -> int:
    """Host processes to kill so that at least ``fraction`` of ``rollouts`` die (whole processes)."""
    return max(1, math.ceil(fraction * rollouts / per))


def step_times(rows: list[dict]) -> list[tuple[int, float]]:
    """``(step, end time)`` of each training row (the last row of a re-trained step), in step order."""
    out: dict[int, float] = {}
    for r in rows:
        if "loss" in r and "time" in r:
            out[int(r["step"])] = float(r["time"])
    return sorted(out.items())


def stall(rows: list[dict], killed_at: float) -> tuple[float, float]:
    """``(stall_s, version_interval_s)``: the longest interval between consecutive learner steps among those that
    end after ``killed_at`` (the interval spanning the kill included), and the median interval of the steps before
    it (from the second on). Raises ``ValueError`` without two steps on each side."""
    times = [t for _, t in step_times(rows)]
    gaps = [(b, b - a) for a, b in zip(times, times[1:])]
    before = [g for end, g in gaps[1:] if end <= killed_at]
    after = [g for end, g in gaps if end > killed_at]
    if len(before) < 1 or not after:
        raise ValueError(f"need learner steps before and after the kill at {killed_at:.1f}; step ends: {times}")
    return round(max(after), 2), round(statistics.median(before), 2)


def learner_idle(rows: list[dict]) -> float:
    """Sum of ``sample_wait_s`` / sum of ``step_s`` over the training rows after the first step (its wait is the
    fleet starting)."""
    train = [r for r in rows if "loss" in r and int(r["step"]) > 1]
    busy = sum(float(r["step_s"]) for r in train)
    return round(sum(float(r["sample_wait_s"]) for r in train) / busy, 4) if busy else 0.0


def figures(summary: dict, rows: list[dict], group_size: int) -> dict:
    """The figures of one run from its summary (``controller.run``) and ``metrics.jsonl`` rows."""
    replay, sup = summary["replay"], summary["supervisor"]
    times = [t for _, t in step_times(rows)]
    window = (times[-1] - times[0]) if len(times) > 1 else float("nan")
    inserted = float(replay["inserted_total"])
    return {"tick_p50_s": sup["tick_p50_s"], "tick_p99_s": sup["tick_p99_s"], "tick_max_s": sup["tick_max_s"],
            "ticks": sup["ticks"],
            "insert_p50_s": round(replay["insert_latency_p50_s"], 4), "insert_p99_s": round(replay["insert_latency_p99_s"], 4),
            "lease_p50_s": round(replay["lease_prompts_latency_p50_s"], 4),
            "lease_p99_s": round(replay["lease_prompts_latency_p99_s"], 4),
            "ingest_groups_per_s": round(inserted / group_size / window, 2),
            "ingest_mb_per_s": round(float(replay.get("wal_bytes", 0)) / 1e6 / window, 3),
            "stale_drop_fraction": round(float(replay["dropped_stale_total"]) / max(inserted, 1.0), 4),
            "learner_idle_fraction": learner_idle(rows), "steps": len(times), "train_window_s": round(window, 1)}


# ---- the runs ----------------------------------------------------------------------------------------------
def make_recipe(model: Path, run_dir: Path, rollouts: int, shards: int, steps: int, group_s: float,
                groups_per_step: int):
    """The tiny-test recipe at fleet size ``rollouts``: ``groups_per_step`` groups of 2 per step, staleness 2,
    each rollout's groups taking ``group_s`` seconds on the simulated engine, replay in ``shards`` shards, rollouts
    hosted ``per_process(rollouts)`` to a process. Rollouts stop leasing while half a step of groups is ready."""
    from gyre.services.control.recipe.schema import load_recipe

    return load_recipe(RECIPE, {
        "model": str(model), "run_dir": str(run_dir), "name": f"fleet-{rollouts}", "ray.num_cpus": 2,
        "eval_before": False, "eval_after": False, "rollout.num_workers": rollouts,
        "rollout.group_size": 2, "rollout.groups_in_flight": 2,
        "rollout.max_ready_groups": max(groups_per_step // 2, 1),
        "rollout.engine.kind": "simulated", "rollout.engine.simulated": {"seconds_per_group": group_s},
        "placement.rollout.rollouts_per_process": per_process(rollouts),
        "replay.shards": shards, "replay.max_staleness": 2, "replay.prompt_lease_ttl_s": 30,
        "learner.groups_per_step": groups_per_step, "learner.num_steps": steps, "learner.sample_timeout_s": 600})


class FleetChaos(RunWatcher):
    """Beside ``controller.run``: samples the hosts' memory and the machine's load once training runs, then (past
    ``kill_after``) SIGKILLs ``kill_hosts`` host processes and ``replay-shard-1``, and waits until the supervisor
    restarted them."""

    def __init__(self, run: str, namespace: str, kill_after: int, kill_hosts: int) -> None:
        super().__init__(run, namespace)
        self.kill_after, self.kill_hosts = kill_after, kill_hosts
        self.rss_bytes = 0
        self.hosts = 0
        self.load = 0.0
        """The machine's 1-minute load average once training runs (2 cores: above 2, processes wait for a core)."""
        self.killed_rollouts: list[str] = []
        self.killed_at = 0.0
        self.restored_s: float | None = None

    def watch(self) -> None:
        import psutil

        st = self.wait(lambda s: (s["learner_version"] or 0) >= 2, "training underway", timeout_s=1800)
        pids = sorted({x["pid"] for x in st["services"] if x["role"] == "rollout" and x["pid"]})
        self.hosts, self.rss_bytes = len(pids), sum(psutil.Process(p).memory_info().rss for p in pids)
        time.sleep(5.0)  # into steady training
        self.load = round(os.getloadavg()[0], 2)
        if self.kill_hosts == 0:
            return
        st = self.wait(lambda s: (s["learner_version"] or 0) >= self.kill_after, "the kill point", timeout_s=1800)
        rollouts = [x for x in st["services"] if x["role"] == "rollout" and x["pid"]]
        victims = sorted({x["pid"] for x in rollouts})[:self.kill_hosts]
        shard = next(x["pid"] for x in st["services"] if x["name"] == "replay-shard-1")
        self.killed_rollouts = sorted(x["name"] for x in rollouts if x["pid"] in victims)
        self.killed_at = time.time()
        for pid in [*victims, shard]:
            os.kill(pid, signal.SIGKILL)
        killed = {*self.killed_rollouts, "replay-shard-1"}
        try:
            self.wait(lambda s: all(s["restarts"].get(n, 0) >= 1 for n in killed) and all(
                x["pid"] and x["pid"] not in (*victims, shard) for x in s["services"] if x["name"] in killed),
                "every killed service restarted", timeout_s=600)
        except TimeoutError:
            if not self.stop.is_set():  # not seen while the run lasted: its summary's restart counts say
                raise
            return
        self.restored_s = round(time.time() - self.killed_at, 1)


def model_bytes(model: Path) -> int:
    """Bytes of the model's safetensors: what every rollout receives per policy version (the versions change every
    weight, so a sparse delta is the whole tensor)."""
    return sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))


def run_fleet(model: Path, root: Path, rollouts: int, shards: int, steps: int, group_s: float,
              groups_per_step: int, chaos: bool, kill_at: int | None = None) -> dict:
    """One run at fleet size ``rollouts``; its figures, and with ``chaos`` the kills' outcome (at learner step
    ``kill_at``, default half the steps) and ``gyre check``."""
    from rich.console import Console

    from gyre.services.cli.invariants import check_run
    from gyre.services.control.orchestration import controller

    recipe = make_recipe(model, root, rollouts, shards, steps, group_s, groups_per_step)
    per = per_process(rollouts)
    watcher = FleetChaos(recipe.name, recipe.ray.namespace, kill_after=steps // 2 if kill_at is None else kill_at,
                         kill_hosts=hosts_to_kill(rollouts, per) if chaos else 0)
    t0 = time.monotonic()
    with beside_run(watcher):
        summary = controller.run(recipe, Console(quiet=True))
    rows = read_metrics(recipe.out_dir / "metrics.jsonl")
    out = {"rollouts": rollouts, "shards": shards, "rollouts_per_process": per, "host_processes": watcher.hosts,
           **figures(summary, rows, recipe.rollout.group_size),
           "rss_mb_per_rollout": round(watcher.rss_bytes / 1e6 / rollouts, 1) if watcher.rss_bytes else None,
           "load_avg_1m": watcher.load, "cpu_cores": os.cpu_count(),
           "weights_mb_per_version": round(rollouts * model_bytes(model) / 1e6, 1),
           "final_version": summary["final_version"], "wall_s": round(time.monotonic() - t0, 1)}
    if chaos:
        report = check_run(recipe.out_dir)
        stall_s, interval_s = stall(rows, watcher.killed_at) if watcher.killed_at else (None, None)
        out["chaos"] = {"killed_rollouts": len(watcher.killed_rollouts),
                        "killed_fraction": round(len(watcher.killed_rollouts) / rollouts, 3),
                        "killed_replay_shard": "replay-shard-1" if watcher.killed_at else None,
                        "restarts": {n: summary["restarts"].get(n, 0) for n in
                                     [*watcher.killed_rollouts, *(["replay-shard-1"] if watcher.killed_at else [])]},
                        "restored_s": watcher.restored_s, "stall_s": stall_s, "version_interval_s": interval_s,
                        "check_ok": report.ok, "lost_groups": report.counts.get("lost_groups"),
                        "duplicates_trained": report.counts.get("duplicates_trained"),
                        "trained_groups": report.counts.get("trained_groups"),
                        "error": None if watcher.error is None else repr(watcher.error)[:300]}
    return out


def measure(root: Path, args) -> dict:
    from tests.tiny_model import build_tiny_llama

    t0 = time.monotonic()
    model = build_tiny_llama(root / "tiny-llama")
    base = None
    if args.baseline_rollouts:
        base = run_fleet(model, root / "baseline", args.baseline_rollouts, args.shards, args.steps, args.group_s,
                         args.groups_per_step, chaos=False)
        log(f"baseline at {args.baseline_rollouts} rollouts: {json.dumps(base)}")
    result = run_fleet(model, root / "fleet", args.rollouts, args.shards, args.steps, args.group_s,
                       args.groups_per_step, chaos=not args.no_chaos, kill_at=args.kill_at_step)
    result["group_s"], result["groups_per_step"] = args.group_s, args.groups_per_step
    if base is not None:
        result["baseline"] = base
        result["insert_p99_ratio"] = (round(result["insert_p99_s"] / base["insert_p99_s"], 2)
                                      if base["insert_p99_s"] else None)
    result["bench_wall_s"] = round(time.monotonic() - t0, 1)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=16, help="fleet size N (default 16)")
    p.add_argument("--shards", type=int, default=2, help="replay shards K (>= 2: one is killed; default 2)")
    p.add_argument("--steps", type=int, default=20, help="learner steps (default 20; the kills at half)")
    p.add_argument("--group-s", type=float, default=1.0, help="seconds each simulated group takes (default 1)")
    p.add_argument("--groups-per-step", type=int, default=16, help="the learner's groups per step (default 16)")
    p.add_argument("--baseline-rollouts", type=int, default=4, help="baseline fleet size (0: no baseline run)")
    p.add_argument("--no-chaos", action="store_true", help="no kills (and no gyre check)")
    p.add_argument("--kill-at-step", type=int, default=None,
                   help="kill once the learner reached this step (default: half the steps; >= 2)")
    p.add_argument("--dir", default=None, help="keep the runs here (default: a temporary folder, removed)")
    args = p.parse_args()
    if args.shards < 2 and not args.no_chaos:
        p.error(f"--shards ({args.shards}) must be >= 2 to kill one shard (or pass --no-chaos)")
    if args.rollouts < 2:
        p.error(f"--rollouts ({args.rollouts}) must be >= 2")
    if args.kill_at_step is not None and not 2 <= args.kill_at_step < args.steps:
        p.error(f"--kill-at-step ({args.kill_at_step}) must be >= 2 (steps before the kill give the version "
                f"interval) and below --steps ({args.steps}: steps after it give the stall)")
    result = run_quietly(lambda root: measure(root, args), args.dir, "gyre-bench-fleet-")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
