"""Pipeline benchmark: ``python -m bench.pipeline [--quick]``. The last line printed is one JSON object.

gyre end to end under the controller (local Ray; durable replay; the DeepSpeed learner on a tiny random
Llama built like the e2e tests' ``tiny_llama``; policy versions over gRPC) with one rollout running the
simulated engine (``rollout.sim_engine``: it sleeps instead of sampling, so generation takes none of the
learner's CPU, like a vLLM engine on its own GPU). Its time per batch is set to the learner's time per
step, measured first in a subprocess (the fastest step of an in-process ``LearnerLoop`` on batches of the
same shape; on a loaded machine this calibration is rough, which only moves ``ideal_speedup`` below 2). Steps are 4 GRPO
groups of 4 samples of 24 tokens; the learner checkpoints every step (a restarted learner loses none).

Two runs, the baseline measured in the same invocation:

- **sync**: ``rollout.max_groups_per_version = groups_per_step``: batch t+1 is generated only with the
  weights of step t (synchronous on-policy RL, the verl/TRL default).
- **async**: no version gate (gyre's default): generation of the next batch overlaps the train step.

``async_speedup`` = async steps/s ÷ sync steps/s, each over the same number of steps after a warm-up, a
step's time being the interval between the learner's end stamps of consecutive steps (medians, as the other
benchmarks; ``async_speedup_wall`` is the same ratio of the windows' total times).
From the sync run's steps (medians): ``T_train`` = the learner's busy time per step (train + publish +
checkpoint: ``step_s - sample_wait_s``) and ``T_gen`` = its wait for the batch (``sample_wait_s``: weight
delivery, generation, scoring, insert), so a sync step takes ``T_gen + T_train``. Perfect overlap takes
``max(T_gen, T_train)`` per step: ``ideal_speedup = (T_gen + T_train) / max(T_gen, T_train)`` and
``overlap_efficiency = async_speedup / ideal_speedup`` (goal ≥ 0.9).

Recovery (after the async measurement window, one service at a time): SIGKILL the process of replay, then
the learner, then rollout-0. ``recovery_s_<service>`` = seconds from the kill until the learner completes
its first step that needed the replacement: for the learner, the first step the restarted learner
completes; for replay, the first step whose batch was sampled after the kill (it can only come from the
restarted replay); for the rollout, the first step whose batch was sampled after the supervisor reported
the restarted rollout generating. ``restart_s_<service>``: kill → the replacement reported alive (status
polled every 0.5 s). Step end times are the learner's own wall-clock stamps (``metrics.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.run_watch import RunWatcher, beside_run
from bench.workdir import run_quietly
from gyre.services.control.outputs.report import read_metrics

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "deploy/recipes/tiny-test.yaml"
SERVICES = ("replay", "learner", "rollout-0")
PROMPT_TOKENS = 43
"""Prompt length of the calibration batches (the tiny-test arithmetic prompts with SmolLM2's chat template)."""


# ---- pure logic: from metrics rows to the result -------------------------------------------------------
def step_rows(rows: list[dict]) -> list[dict]:
    """Training-step rows of a ``metrics.jsonl`` (they carry ``loss``), by step; a step logged twice (a
    restarted learner re-training it) keeps its last row."""
    by_step = {r["step"]: r for r in rows if "loss" in r}
    return [by_step[s] for s in sorted(by_step)]


def step_intervals(rows: list[dict], warmup: int, steps: int) -> list[float]:
    """Seconds between the end stamps of consecutive steps, for steps ``warmup + 1 .. warmup + steps``.

    Raises:
        ValueError: ``warmup < 1`` or ``steps < 1``, or a step of the window (or step ``warmup``) is missing.
    """
    if warmup < 1 or steps < 1:
        raise ValueError(f"warmup ({warmup}) and steps ({steps}) must be >= 1")
    times = {r["step"]: r["time"] for r in rows}
    missing = [s for s in range(warmup, warmup + steps + 1) if s not in times]
    if missing:
        raise ValueError(f"steps {missing} missing from the metrics (have {sorted(times)})")
    return [times[s] - times[s - 1] for s in range(warmup + 1, warmup + steps + 1)]


def sync_times(rows: list[dict], warmup: int, steps: int) -> tuple[float, float]:
    """``(T_gen, T_train)`` in seconds: medians over the window of ``sample_wait_s`` and of
    ``step_s - sample_wait_s`` (train + publish + checkpoint)."""
    window = [r for r in rows if warmup < r["step"] <= warmup + steps]
    if not window:
        raise ValueError(f"no step rows in ({warmup}, {warmup + steps}]")
    return (statistics.median(r["sample_wait_s"] for r in window),
            statistics.median(r["step_s"] - r["sample_wait_s"] for r in window))


def ideal_speedup(t_gen: float, t_train: float) -> float:
    """Speedup of perfectly overlapping generation with training over running them in turn:
    ``(T_gen + T_train) / max(T_gen, T_train)``, in [1, 2]. Raises ``ValueError`` unless both are > 0."""
    if t_gen <= 0 or t_train <= 0:
        raise ValueError(f"T_gen ({t_gen}) and T_train ({t_train}) must be > 0 seconds")
    return (t_gen + t_train) / max(t_gen, t_train)


def recovery_s(rows: list[dict], service: str, killed_at: float, back_at: float) -> float | None:
    """Seconds from ``killed_at`` (wall clock) to the end of the first learner step that needed the
    replacement of ``service`` (``replay``, ``learner`` or ``rollout``; see the module docstring), over
    every training row (a re-trained step's rows included); ``None`` if no such step was logged."""
    rows = sorted((r for r in rows if "loss" in r), key=lambda r: r["time"])
    restarts_before = max((r.get("learner_restarts", 0) for r in rows if r["time"] <= killed_at), default=0)
    for r in rows:
        sampled_at = r["time"] - r["step_s"] + r["sample_wait_s"]
        if service == "learner":
            ok = r.get("learner_restarts", 0) > restarts_before and r["time"] > killed_at
        elif service == "replay":
            ok = sampled_at > killed_at
        else:
            ok = sampled_at > back_at
        if ok:
            return r["time"] - killed_at
    return None


def build_result(sync_rows: list[dict], async_rows: list[dict], warmup: int, steps: int,
                 kills: dict[str, tuple[float, float]], sim_gen_s: float) -> dict:
    """The benchmark's JSON object from both runs' step rows, the kills ``{service: (killed_at, back_at)}``
    (wall-clock seconds) and the simulated engine's seconds per group."""
    sync_gaps = step_intervals(step_rows(sync_rows), warmup, steps)
    async_gaps = step_intervals(step_rows(async_rows), warmup, steps)
    sync_rate, async_rate = 1 / statistics.median(sync_gaps), 1 / statistics.median(async_gaps)
    t_gen, t_train = sync_times(step_rows(sync_rows), warmup, steps)
    ideal = ideal_speedup(t_gen, t_train)
    speedup = async_rate / sync_rate
    result = {"async_speedup": speedup, "ideal_speedup": ideal, "overlap_efficiency": speedup / ideal,
              "async_speedup_wall": sum(sync_gaps) / sum(async_gaps), "sync_steps_per_s": sync_rate,
              "async_steps_per_s": async_rate, "steps": steps, "warmup_steps": warmup,
              "t_gen_s": t_gen, "t_train_s": t_train,
              "async_t_train_s": sync_times(step_rows(async_rows), warmup, steps)[1],
              "sim_gen_s": sim_gen_s}
    for service in SERVICES:  # a service the chaos did not get to (it failed: chaos_error) reports None
        key, kill = service.split("-")[0], kills.get(service)
        result[f"recovery_s_{key}"] = recovery_s(async_rows, key, *kill) if kill else None
        result[f"restart_s_{key}"] = kill[1] - kill[0] if kill else None
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}


# ---- calibration: the learner's time per step, in a subprocess ----------------------------------------
def calibrate(model: str, recipe, steps: int) -> float:
    """Seconds of a ``LearnerLoop`` step's busy part (train + publish + checkpoint) on random batches shaped
    like the run's: the fastest of ``steps`` after a warm-up step (the least disturbed by other processes on a
    shared machine). Runs in a fresh subprocess (no DeepSpeed state stays in this one) with the torch threads
    the learner actor gets. Raises ``RuntimeError`` with the subprocess's stderr if it fails."""
    spec = {"model": model, "learner": recipe.learner.model_dump(mode="json"), "steps": steps,
            "group_size": recipe.rollout.group_size, "response_tokens": recipe.rollout.sampling.max_new_tokens}
    # The learner actor's torch threads: Ray sets OMP_NUM_THREADS to its whole CPUs (at least 1) unless set.
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(int(recipe.placement.learner.num_cpus), 1))
    out = subprocess.run([sys.executable, "-m", "bench.pipeline", "--calibrate", json.dumps(spec)], cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": threads}, capture_output=True, text=True,
                         check=False, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"calibration failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    busy = json.loads(out.stdout.strip().splitlines()[-1])["busy_s"]
    log(f"calibration steps (s): {[round(b, 3) for b in busy]}")
    return min(busy)


def calibrate_main(spec: dict) -> None:
    """Subprocess body of ``calibrate``: prints ``{"busy_s": [seconds of each step after the warm-up]}``."""
    from transformers import AutoTokenizer

    from bench.learner import make_table
    from gyre.learner.engine import LearnerEngine
    from gyre.learner.loop import LearnerLoop, LearnerLoopConfig
    from gyre.learner.publisher import WeightPublisher
    from gyre.replay.buffer import TrajectoryBuffer
    from gyre.replay.config import ReplayConfig

    cfg = LearnerLoopConfig(**spec["learner"])
    steps = spec["steps"] + 1  # the first step warms up
    buffer = TrajectoryBuffer(ReplayConfig(max_staleness=10**6))
    buffer.insert(make_table(cfg.groups_per_step * steps, spec["group_size"], PROMPT_TOKENS, spec["response_tokens"]))
    pad = AutoTokenizer.from_pretrained(spec["model"]).pad_token_id
    with tempfile.TemporaryDirectory(prefix="gyre-bench-calib-") as ckpt:
        loop = LearnerLoop(cfg, LearnerEngine(cfg.engine, cfg.algorithm), buffer, WeightPublisher(), pad, Path(ckpt))
        rows = [loop.step() for _ in range(steps)]
    print(json.dumps({"busy_s": [r["step_s"] - r["sample_wait_s"] for r in rows[1:]]}))


# ---- the runs ----------------------------------------------------------------------------------------
def make_recipe(model: Path, run_dir: Path, name: str, num_steps: int, sim_gen_s: float, sync: bool):
    """The tiny-test recipe (4 groups of 4 per step, 24 response tokens, a checkpoint every step) with one
    rollout on the simulated engine taking ``sim_gen_s`` seconds per group (the 4 groups of a batch
    generate concurrently); ``sync`` gates it at ``groups_per_step`` groups per policy version."""
    from gyre.services.control.recipe.schema import load_recipe

    groups = 4
    return load_recipe(RECIPE, {
        "model": str(model), "run_dir": str(run_dir), "name": name, "ray.num_cpus": 2,
        "eval_before": False, "eval_after": False, "rollout.group_size": 4, "rollout.groups_in_flight": groups,
        "rollout.max_ready_groups": groups, "rollout.max_groups_per_version": groups if sync else None,
        "rollout.sampling.max_new_tokens": 24,
        "rollout.engine.kind": "simulated", "rollout.engine.simulated": {"seconds_per_group": sim_gen_s},
        "replay.max_staleness": 2, "learner.groups_per_step": groups, "learner.num_steps": num_steps,
        "learner.save_interval": 1, "learner.sample_timeout_s": 300})


class Chaos(RunWatcher):
    """In a thread beside ``controller.run``: once the learner passed ``after_version``, SIGKILLs each
    service in ``SERVICES`` in turn, waiting until it is back and the learner trained again."""

    def __init__(self, run: str, namespace: str, after_version: int, metrics: Path) -> None:
        super().__init__(run, namespace, attach_timeout_s=300)
        self.after_version, self.metrics = after_version, metrics
        self.kills: dict[str, tuple[float, float]] = {}

    def watch(self) -> None:
        self.wait(lambda s: (s["learner_version"] or 0) >= self.after_version, "measurement window", timeout_s=600)
        for name in SERVICES:
            self._kill(name)

    def _kill(self, name: str) -> None:
        pid = next(s["pid"] for s in self.wait(lambda s: True, "status")["services"] if s["name"] == name)
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        self.wait(lambda s: any(x["name"] == name and x["pid"] not in (None, pid) for x in s["services"]),
                  f"{name} restarted")
        self.kills[name] = (killed_at, time.time())
        self.wait(lambda s: self._recovered(name), f"a learner step after the {name} restart")

    def _recovered(self, name: str) -> bool:
        try:
            rows = read_metrics(self.metrics)
        except ValueError:  # the controller is writing the last line right now: look again next poll
            return False
        return recovery_s(rows, name.split("-")[0], *self.kills[name]) is not None


def run_phase(recipe, chaos: Chaos | None = None) -> tuple[dict, list[dict]]:
    """``controller.run(recipe)`` (quietly); returns its summary and its ``metrics.jsonl`` rows."""
    from rich.console import Console

    from gyre.services.control.orchestration import controller

    if chaos is None:
        summary = controller.run(recipe, Console(quiet=True))
    else:
        with beside_run(chaos):
            summary = controller.run(recipe, Console(quiet=True))
    return summary, read_metrics(recipe.out_dir / "metrics.jsonl")


def measure(root: Path, quick: bool) -> dict:
    """Calibrate, run sync then async (with the kills); returns the result object."""
    from tests.tiny_model import build_tiny_llama

    warmup, steps, recovery_steps = (2, 8, 10) if quick else (3, 24, 14)
    t0 = time.monotonic()
    model = build_tiny_llama(root / "tiny-llama")
    probe = make_recipe(model, root, "probe", 1, 0.0, sync=True)
    sim_gen_s = calibrate(str(model), probe, steps=4 if quick else 6)
    log(f"calibrated learner step: {sim_gen_s:.3f} s ({time.monotonic() - t0:.0f} s)")
    sync = make_recipe(model, root, "sync", warmup + steps, sim_gen_s, sync=True)
    sync_summary, sync_rows = run_phase(sync)
    log(f"sync run done ({time.monotonic() - t0:.0f} s)")
    asyn = make_recipe(model, root, "async", warmup + steps + recovery_steps, sim_gen_s, sync=False)
    # Kill once step warmup + steps is logged (the learner's version passes it when the next step trains).
    chaos = Chaos(asyn.name, asyn.ray.namespace, warmup + steps + 1, asyn.out_dir / "metrics.jsonl")
    _, async_rows = run_phase(asyn, chaos)
    log(f"async run done ({time.monotonic() - t0:.0f} s); chaos error: {chaos.error!r}")
    result = build_result(sync_rows, async_rows, warmup, steps, chaos.kills, sim_gen_s)
    from tests.training import training_summary

    trained = {name: {k: t[k] for k in ("steps", "steps_with_grad", "tensors", "tensors_moved")}
               for name, r in (("sync", sync), ("async", asyn)) if (t := training_summary(r.out_dir, model))}
    return result | {"training": trained,"sync_weight_updates": sync_summary["rollout_stats"][0]["weight_updates"], "quick": quick,
                     "wall_s": round(time.monotonic() - t0, 1),
                     "chaos_error": None if chaos.error is None else repr(chaos.error)[:300]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (about 3-4 minutes on 2 CPU cores)")
    parser.add_argument("--dir", default=None, help="where runs go (default: a temp dir, removed)")
    parser.add_argument("--calibrate", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.calibrate:
        calibrate_main(json.loads(args.calibrate))
        return
    result = run_quietly(lambda root: measure(root, args.quick), args.dir, "gyre-bench-pipeline-")
    print(json.dumps(result))


def log(message: str) -> None:
    print(f"[bench.pipeline] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
