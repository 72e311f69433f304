"""The controller (Ray driver): starts replay, learner and rollouts as Ray actors, wires them, runs
the recipe, evaluates before/after, and writes the run directory."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import structlog
from rich.console import Console

from services.actors import LearnerActor, ReplayActor, RolloutActor
from services.progress import RunProgress
from services.recipe import Recipe
from services.report import MetricsWriter, plot_run

log = structlog.get_logger("controller")
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Topology:
    replay: ray.actor.ActorHandle
    learner: ray.actor.ActorHandle
    rollouts: list[ray.actor.ActorHandle]


def actor_env() -> dict:
    """Environment every service process gets (JIT cache for DeepSpeed ops, import path)."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache/torch_extensions")),
           "TOKENIZERS_PARALLELISM": "false"}
    for key in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "HF_HUB_OFFLINE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def task_fingerprint(recipe: Recipe) -> str:
    """``task=<sha256[:16] of the task config JSON>``: stored in learner checkpoints, so resuming
    under another task or dataset is refused unless forced."""
    digest = hashlib.sha256(recipe.task.model_dump_json().encode()).hexdigest()[:16]
    return f"task={recipe.task.name}:{digest}"


def start_services(recipe: Recipe) -> Topology:
    """Replay first (everyone talks to it), then the learner (publishes version 0), then rollouts."""
    opts = {"num_cpus": 0, "runtime_env": {"env_vars": actor_env()}}
    replay_dir = recipe.replay.dir or str(recipe.out_dir.resolve() / "replay")
    replay = ReplayActor.options(**opts).remote(recipe.replay.model_dump(), dir=replay_dir)
    replay_address = ray.get(replay.address.remote())
    learner_cfg = recipe.learner.model_dump()
    learner_cfg["fingerprint"] = learner_cfg["fingerprint"] or task_fingerprint(recipe)
    learner = LearnerActor.options(max_concurrency=4, **opts).remote(
        learner_cfg, replay_address, checkpoint_dir=str(recipe.out_dir.resolve() / "checkpoints"))
    weights_address = ray.get(learner.weights_address.remote())
    rollouts = [RolloutActor.options(**opts).remote() for _ in range(recipe.rollout.num_workers)]
    ray.get([r.setup.remote(f"rollout-{i}", recipe.rollout.model_dump(), recipe.task.model_dump(),
                            replay_address, weights_address, recipe.seed + i) for i, r in enumerate(rollouts)])
    log.info("services_started", replay=replay_address, weights=weights_address, rollouts=len(rollouts))
    return Topology(replay, learner, rollouts)


def run(recipe: Recipe, console: Console | None = None) -> dict:
    """Run a recipe end to end; returns the summary also written to ``{out_dir}/summary.json``."""
    console = console or Console()
    out = recipe.out_dir
    archived = archive_previous_run(out)
    if archived:
        console.print(f"moved the previous run in {out} to {archived} (resuming a run is not supported yet)")
    out.mkdir(parents=True)
    (out / "recipe.json").write_text(recipe.model_dump_json(indent=2))
    t0 = time.time()
    ray.init(address=recipe.ray.address, num_cpus=recipe.ray.num_cpus, namespace=recipe.ray.namespace,
             include_dashboard=False, log_to_driver=False, object_store_memory=256 * 1024**2
             if recipe.ray.address == "local" else None)
    metrics = MetricsWriter(out / "metrics.jsonl")
    try:
        with console.status("starting replay, learner (DeepSpeed) and rollouts (vLLM)…"):
            topo = start_services(recipe)
        summary = _train(recipe, topo, metrics, console)
        with console.status("checkpointing and exporting the final policy…"):
            summary.update(ray.get(topo.learner.finalize.remote(str(out))))
        summary["replay"] = ray.get(topo.replay.info.remote())
        ray.get([r.stop.remote() for r in topo.rollouts])
        ray.get([topo.learner.stop.remote(), topo.replay.stop.remote()])
    finally:
        metrics.close()
        ray.shutdown()
    summary["plot"] = str(plot_run(out / "metrics.jsonl", out / "reward_accuracy.png"))
    summary["wall_time_s"] = round(time.time() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def archive_previous_run(out: Path) -> Path | None:
    """Move an existing run directory aside as ``{out}.{timestamp}`` so a new run starts clean.

    A fresh learner must never meet the previous run's replay state (its data would all be stale).
    """
    if not out.exists():
        return None
    target = out.with_name(f"{out.name}.{time.strftime('%Y%m%d-%H%M%S')}")
    out.rename(target)
    return target


def _train(recipe: Recipe, topo: Topology, metrics: MetricsWriter, console: Console) -> dict:
    summary: dict = {"run": recipe.name}
    lead = topo.rollouts[0]
    if recipe.eval_before:
        with console.status("evaluating the initial policy on the held-out set…"):
            before = ray.get(lead.evaluate.remote())
        metrics.write({"step": 0, "time": time.time(), **before})
        summary["heldout_accuracy_before"] = before["heldout_accuracy"]
        console.print(f"held-out accuracy before training: {before['heldout_accuracy']:.3f}")
    ray.get([r.start.remote() for r in topo.rollouts])
    steps = recipe.learner.num_steps
    run_ref = topo.learner.run.remote(steps)
    cursor = 0
    with RunProgress(console, steps) as progress:
        while True:
            rows, done, error = ray.get(topo.learner.progress.remote(cursor))
            stats = ray.get([r.stats.remote() for r in topo.rollouts])
            for row in rows:
                row["rollout_tokens_per_s"] = sum(s["tokens_per_s"] for s in stats)
                row["rollout_versions"] = [s["version"] for s in stats]
                metrics.write(row)
                progress.update(row)
            cursor += len(rows)
            if done:
                break
            time.sleep(1.0)
    final_version = ray.get(run_ref)  # re-raises a learner failure with its traceback
    ray.get([r.pause.remote() for r in topo.rollouts])
    summary["final_version"] = final_version
    if recipe.eval_after:
        with console.status("evaluating the final policy on the held-out set…"):
            got = ray.get(lead.wait_for_version.remote(final_version, 600))
            if got < final_version:
                raise RuntimeError(f"rollout-0 reached policy version {got}, not {final_version}, within 600 s")
            after = ray.get(lead.evaluate.remote())
        metrics.write({"step": final_version, "time": time.time(), **after})
        summary["heldout_accuracy_after"] = after["heldout_accuracy"]
        console.print(f"held-out accuracy after training: {after['heldout_accuracy']:.3f}")
    summary["rollout_stats"] = ray.get([r.stats.remote() for r in topo.rollouts])
    return summary
