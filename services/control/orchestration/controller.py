"""The controller (Ray driver): starts replay, learner and rollouts as detached, named Ray actors
(``services.control.orchestration.supervisor``), runs the recipe while supervising them, evaluates before/after, and writes the
run directory.

Resume (``gyre run --resume``): ``auto`` (default) re-uses ``{run_dir}/{name}``: replay restores from its
directory, the learner resumes from its newest verified checkpoint, ``metrics.jsonl`` is appended to, live
service actors of the run (a driver that died) are re-attached, and a run whose ``summary.json`` exists
is reported as finished. ``none`` moves the old run directory aside and starts fresh; a checkpoint path
resumes the learner from it (in the existing run directory).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import ray
import structlog
from ray.exceptions import GetTimeoutError, RayActorError
from rich.console import Console
from tenacity import RetryCallState, Retrying, retry_if_exception, retry_if_exception_type, stop_after_attempt

from gyre.rollout.stats import merge_reward_means
from gyre.services.common.replay_shards import merge_info_dicts
from gyre.services.control.orchestration.evaluation import PeriodicEval, eval_line, record_eval
from gyre.services.control.commands.ops import create_state
from gyre.services.control.orchestration.progress import RunProgress
from gyre.services.control.commands.ray_connection import CONNECTION_FILE, record_connection
from gyre.services.control.recipe.schema import Recipe
from gyre.services.control.recipe.recorded import rollouts_to_start, use_recording
from gyre.services.control.outputs.report import (MetricsWriter, learner_step_summary, plot_run, read_metrics,
                                                  recover_rows)
from gyre.services.control.orchestration.rollout_time import RolloutTimeDeltas, spread
from gyre.services.control.outputs.run_dir import write_recipe
from gyre.services.control.outputs.run_lock import hold_run_dir
from gyre.services.control.orchestration.supervisor import ServiceFactory, Supervisor
from gyre.services.control.outputs.tracking import Trackers, open_trackers

log = structlog.get_logger("controller")
REPO = Path(__file__).resolve().parents[3]


def actor_env() -> dict:
    """Environment every service process gets: the JIT cache for DeepSpeed ops, the import path, and gRPC's fork
    handlers off (``GRPC_ENABLE_FORK_SUPPORT=false`` unless the driver's environment sets it).

    gRPC's fork handlers restart its poller in a child that ``subprocess`` forked from a process with live channels,
    and that child can abort in ``ev_epoll1_linux.cc`` (``Check failed: next_worker->state == KICKED``) before it
    reaches ``exec`` (grpc/grpc#43055, grpcio >= 1.80). A rollout forks such children all the time: every episode
    of a verifiers environment starts its harness program, every sandboxed reward its checker. gyre never uses a
    gRPC channel across ``fork`` (services spawn, never fork, a process that uses gRPC), so the handlers only
    cost it those aborts."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache/torch_extensions")),
           "TOKENIZERS_PARALLELISM": "false",
           "GRPC_ENABLE_FORK_SUPPORT": os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "false")}
    for key in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING",
                *HF_ENV):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


HF_ENV = ("HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT")
"""Hugging Face settings a service inherits from the driver, so that a node fetching a Hub id's pinned commit
(``utils.model_source.localize``) uses the same cache layout, endpoint and offline choice. Tokens are not
passed through Ray: a node that fetches a gated model needs its own ``HF_TOKEN`` / ``hf auth login``."""


def task_fingerprint(recipe: Recipe) -> str:
    """The task/dataset configuration as canonical JSON (sorted keys): stored in learner checkpoints, so
    resuming under another task or dataset is refused unless forced (``--force-resume``), and the refusal can
    list exactly which keys differ (``learner.checkpoint.store.fingerprint_diff``). A task with datasets adds
    ``data: {task: rollout.dataset_files.data_fingerprint}`` (sha256 of each local data file, a tree hash),
    so an edited, added or removed data file is named too.

    Raises:
        rollout.dataset_files.DatasetError: a dataset path that does not exist."""
    from gyre.rollout.dataset_files import data_fingerprint

    out: dict = {"task": recipe.task.model_dump(mode="json")}
    data = {name: data_fingerprint(c.dataset) for name, c in recipe.task.components().items() if c.dataset}
    if data:
        out["data"] = data
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


RAY_START_ATTEMPTS = 2
"""Tries at starting a private local Ray (``address: local``) before its start error is raised."""
START_WINDOW_ERRORS = ("timed out during startup", "Timed out waiting for file")
"""Ray's messages when a process of a starting node missed its fixed window: the raylet registering
("The current node timed out during startup"), the GCS server writing its port file ("Timed out waiting
for file .../gcs_server_port_...")."""
GCS_PORT_WAIT_S = "120"
"""``RAY_gcs_server_port_wait_time_s`` for a private local Ray unless set: Ray waits 30 s for a new GCS
server's port, which two loaded cores can miss (seen once in a full ``make test``: no GCS log file yet)."""


def init_ray(address: str, **kwargs) -> None:
    """``ray.init(address=address, **kwargs)``, starting a private local Ray up to ``RAY_START_ATTEMPTS``
    times: on a loaded machine its raylet or GCS server can miss the fixed window Ray gives it
    (``START_WINDOW_ERRORS``); the half-started node is shut down and started again. A local start also
    gives the GCS server ``GCS_PORT_WAIT_S`` seconds instead of 30 unless the environment sets it.
    Attaching to an existing cluster (any other ``address``) is tried once. Raises what ``ray.init`` raised."""
    if address == "local":
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", GCS_PORT_WAIT_S)

    def restart(state: RetryCallState) -> None:
        log.warning("ray_start_timed_out_retrying", attempt=state.attempt_number,
                    error=str(state.outcome.exception())[:200])
        ray.shutdown()  # the half-started node

    # Ray raises a bare Exception / RuntimeError for these
    missed_window = retry_if_exception(lambda exc: any(m in str(exc) for m in START_WINDOW_ERRORS))
    Retrying(retry=missed_window, stop=stop_after_attempt(RAY_START_ATTEMPTS if address == "local" else 1),
             before_sleep=restart, reraise=True)(ray.init, address=address, **kwargs)


def run(recipe: Recipe, console: Console | None = None) -> dict:
    """Run (or resume, per ``recipe.learner.resume``) a recipe end to end; returns the summary also
    written to ``{out_dir}/summary.json``. A finished run returns its summary with ``already_finished``.

    Raises:
        RunDirBusyError: another driver holds ``{out_dir}`` (``services.control.outputs.run_lock``); nothing was touched.
    """
    console = console or Console()
    with hold_run_dir(recipe.out_dir):
        return _run(recipe, console)


def _run(recipe: Recipe, console: Console) -> dict:
    out = recipe.out_dir
    finished = prepare_run_dir(recipe, console)
    if finished is not None:
        return finished
    recipe = use_recording(recipe, console)  # replay.source: replay gets a copy of the recording (record once)
    write_recipe(out, recipe.model_dump_json(indent=2))
    console.print(f"outputs in {out}; each service's log in {out / 'logs'}/<service>.log", highlight=False)
    trackers = open_trackers(recipe.tracking, out, recipe.name, recipe.model_dump(mode="json"))
    console.print(trackers.describe(), highlight=False)
    try:
        summary = _run_services(recipe, console, trackers)
    except BaseException:  # a failed or interrupted run still closes its tracker runs, marked failed
        trackers.close(failed=True)
        raise
    trackers.log_summary(summary, summary.get("final_version", 0))
    trackers.close()
    return summary


def _run_services(recipe: Recipe, console: Console, trackers: Trackers) -> dict:
    """Start (or re-attach) the services, train, evaluate, finalize; write ``summary.json`` and return it."""
    out = recipe.out_dir
    t0 = time.time()
    init_ray(recipe.ray.address, num_cpus=recipe.ray.num_cpus, namespace=recipe.ray.namespace,
             include_dashboard=False, log_to_driver=False, object_store_memory=256 * 1024**2
             if recipe.ray.address == "local" else None)
    # for `gyre status` and friends: the address (kept for scripts) and how to join (address, auth mode, token file)
    (out / "ray_address").write_text(ray.get_runtime_context().gcs_address)
    record_connection(out)
    metrics = MetricsWriter(out / "metrics.jsonl", trackers)
    state = sup = None
    try:
        state = create_state(recipe.name, recipe.ray.namespace, rollouts_to_start(recipe))
        sup = Supervisor(ServiceFactory(recipe, actor_env(), task_fingerprint(recipe)), state)
        with console.status("starting replay, learner (DeepSpeed) and rollouts (vLLM)…"):
            attached = sup.start(rollouts_to_start(recipe))
        _print_restored(sup, attached, console)
        # a re-attached learner still holds the rows an earlier driver already wrote; a new one resumed from a
        # checkpoint whose steps' rows a killed driver may never have written (the learner's own copy has them)
        written = _last_step(out / "metrics.jsonl") if "learner" in attached else -1
        if "learner" not in attached:
            recover_rows(out, metrics, ray.get(sup.learner.handle.version.remote()))
        summary = _train(recipe, sup, metrics, console, written)
        with console.status("checkpointing and exporting the final policy…"):
            summary.update(_supervised(sup, lambda: sup.learner.handle.finalize.remote(str(out))))
        summary["replay"] = merge_info_dicts(_supervised(sup, lambda: [s.handle.info.remote()
                                                                        for s in sup.replay_shards()]))
        summary["restarts"] = sup.restart_counts()
        summary["supervisor"] = sup.tick_times.summary()
        summary["rollout_join_s"] = dict(sup.joined_s)  # creation to joining at the newest version, per rollout
        summary["deaths"] = [d.to_dict() for d in sup.deaths]  # each death handled, with the incarnation it ended
        sup.shutdown()
        ray.kill(state, no_restart=True)
    except Exception:  # a failed run releases its detached actors; a killed driver (or Ctrl-C) leaves them
        _release(sup, state)  # for the next `gyre run` to re-attach
        raise
    finally:
        metrics.close()
        (out / "ray_address").unlink(missing_ok=True)
        (out / CONNECTION_FILE).unlink(missing_ok=True)
        ray.shutdown()
    summary["plot"] = str(plot_run(out / "metrics.jsonl", out / "reward_accuracy.png"))
    summary |= learner_step_summary(read_metrics(out / "metrics.jsonl"))
    if "learner_step_time_s_median" in summary:
        console.print(f"learner step: median {summary['learner_step_time_s_median']:.2f} s over "
                      f"{summary['learner_steps']:.0f} steps ({summary.get('learner_tokens_per_s_median', 0):.0f} "
                      "tokens/s)", highlight=False)
    summary["wall_time_s"] = round(time.time() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _release(sup: Supervisor | None, state) -> None:
    """Best-effort kill of every service actor and the state actor after a failure (logged, not raised)."""
    try:
        if sup is not None:
            for svc in [*sup.services.values(), *sup.starting.values()]:
                ray.kill(svc.handle, no_restart=True)
        if state is not None:
            ray.kill(state, no_restart=True)
    except Exception as exc:  # cleanup after a failure must not mask the failure itself
        log.warning("release_failed", error=f"{type(exc).__name__}: {str(exc)[:200]}")


def ask_rollouts(sup: Supervisor, method: str, timeout_s: float = 120.0) -> tuple[dict, list[str]]:
    """Call ``method()`` on every running rollout at the end of training (``pause``, ``stats``); returns ``({name:
    answer}, [names that did not answer])``: dead (killed while a replacement starts) or silent for ``timeout_s``. A
    rollout that did not pause lets its prompt leases expire in replay, and nothing it held is lost. Asking them all
    in one ``ray.get`` failed the whole run when one was dead (seen in ``bench.fleet``: a killed host's rollouts were
    still being restarted when the last step ended)."""
    calls = [(svc.name, getattr(svc.handle, method).remote()) for svc in sup.running_rollouts()]
    answers, failed = {}, []
    for name, ref in calls:
        try:
            answers[name] = ray.get(ref, timeout=timeout_s)
        except (RayActorError, GetTimeoutError) as exc:
            log.warning("rollout_call_failed", service=name, method=method, error=str(exc)[:200])
            failed.append(name)
    return answers, failed


def _supervised(sup: Supervisor, call, attempts: int = 3):
    """``ray.get(call())``; if the service died meanwhile (``RayActorError``), let the supervisor restart it
    (``sup.tick()``) and call again, at most ``attempts`` calls in all. Raises the last call's error (a
    ``RayActorError`` of the last call, any other error at once)."""
    def restart(state: RetryCallState) -> None:
        log.warning("service_died_after_training", error=str(state.outcome.exception())[:200])
        sup.tick()

    return Retrying(retry=retry_if_exception_type(RayActorError), stop=stop_after_attempt(attempts),
                    before_sleep=restart, reraise=True)(lambda: ray.get(call()))


def prepare_run_dir(recipe: Recipe, console: Console) -> dict | None:
    """Apply the resume mode to ``{run_dir}/{name}``: ``none`` archives an old one; otherwise it is re-used.
    Returns the old summary (with ``already_finished``) when the run already reached ``num_steps``."""
    out = recipe.out_dir
    if recipe.learner.resume == "none":
        archived = archive_previous_run(out)
        if archived:
            console.print(f"--resume none: moved the previous run in {out} to {archived}", highlight=False)
    elif (out / "summary.json").is_file():
        summary = json.loads((out / "summary.json").read_text())
        if summary.get("final_version", -1) >= recipe.learner.num_steps:
            console.print(f"run {recipe.name} already finished (policy version {summary['final_version']}); "
                          f"outputs in {out}. Use --resume none to start it again.", highlight=False)
            return {**summary, "already_finished": True}
    if out.exists() and recipe.learner.resume != "none":
        console.print(f"resuming run {recipe.name} in {out} (--resume {recipe.learner.resume})", highlight=False)
    out.mkdir(parents=True, exist_ok=True)
    return None


def archive_previous_run(out: Path) -> Path | None:
    """Move an existing run directory aside as ``{out}.{timestamp}`` so a new run starts clean.

    A fresh learner must never meet the previous run's replay state (its data would all be stale).
    """
    if not out.exists():
        return None
    target = out.with_name(f"{out.name}.{time.strftime('%Y%m%d-%H%M%S')}")
    out.rename(target)
    return target


def _print_restored(sup: Supervisor, attached: list[str], console: Console) -> None:
    learner = ray.get(sup.learner.handle.describe.remote())
    replay = merge_info_dicts(ray.get([s.handle.info.remote() for s in sup.replay_shards()]))
    if attached:
        console.print(f"re-attached to running services: {', '.join(attached)}", highlight=False)
    if learner.resumed_from:
        console.print(f"learner resumed from {learner.resumed_from} (policy version {learner.version})",
                      highlight=False)
    if replay["stored_groups"] or replay["prompts_completed"]:
        console.print(f"replay restored {replay['stored_groups']} groups, {replay['prompts_completed']} prompts "
                      "completed", highlight=False)
    log.info("run_restored", attached=attached, learner_checkpoint=learner.resumed_from,
             learner_version=learner.version, replay_groups=replay["stored_groups"])


def _last_step(path: Path) -> int:
    """The highest training ``step`` in a ``metrics.jsonl`` (-1 if none)."""
    steps = [r["step"] for r in read_metrics(path) if "loss" in r] if path.is_file() else []
    return max(steps, default=-1)


def _train(recipe: Recipe, sup: Supervisor, metrics: MetricsWriter, console: Console, written: int = -1) -> dict:
    summary: dict = {"run": recipe.name}
    start_version = ray.get(sup.learner.handle.version.remote())
    if recipe.eval.before and start_version == 0:
        with console.status("evaluating the initial policy on the held-out set…"):
            before = ray.get(sup.rollouts()[0].handle.evaluate.remote(recipe.eval.model_dump()))
        summary["heldout_accuracy_before"] = record_eval(before, recipe.out_dir, metrics, "before")["heldout_accuracy"]
        console.print(f"held-out accuracy before training: {before.metrics['heldout_accuracy']:.3f} "
                      f"({eval_line(before.metrics)})", highlight=False)
    if recipe.replay.source is None:  # a recording's run: its rollouts only evaluate
        sup.start_generation()
    with RunProgress(console, recipe.learner.num_steps) as progress:
        evals = PeriodicEval(recipe.eval, recipe.learner.num_steps, start_version, recipe.out_dir, metrics, progress)
        final_version = _supervise_training(recipe, sup, metrics, progress, written, evals=evals)
        evals.drain()
    ask_rollouts(sup, "pause")
    summary["final_version"] = final_version
    if recipe.eval.after:
        lead = sup.rollouts()[0].handle
        with console.status("evaluating the final policy on the held-out set…"):
            # the learner's timeline too: after a learner crash the rollout may hold the crashed learner's
            # weights under the same number (proto.timeline)
            timeline = ray.get(sup.learner.handle.describe.remote(), timeout=30).timeline
            got = ray.get(lead.wait_for_version.remote(final_version, 600, timeline))
            if got < final_version:
                raise RuntimeError(f"rollout-0 reached policy version {got}, not {final_version} of the learner's "
                                   f"timeline {timeline}, within 600 s")
            after = ray.get(lead.evaluate.remote(recipe.eval.model_dump()))
        summary["heldout_accuracy_after"] = record_eval(after, recipe.out_dir, metrics, "after")["heldout_accuracy"]
        console.print(f"held-out accuracy after training: {after.metrics['heldout_accuracy']:.3f} "
                      f"({eval_line(after.metrics)})", highlight=False)
    summary["rollout_stats"] = list(ask_rollouts(sup, "stats")[0].values())
    return summary


def _supervise_training(recipe: Recipe, sup: Supervisor, metrics: MetricsWriter, progress: RunProgress,
                        written: int = -1, poll_s: float = 1.0, evals: PeriodicEval | None = None) -> int:
    """Poll the learner's progress and tick the supervisor until ``num_steps`` versions exist; after a
    learner restart (it resumed from its newest checkpoint) re-issue ``run(remaining steps)``. Rows of the
    first learner generation up to step ``written`` are not written again (re-attached learner). ``evals``
    is polled each round with the newest learner step (periodic evaluations). Returns the final policy
    version. Raises ``RuntimeError`` with the learner's traceback if training failed.

    A learner that already holds ``num_steps`` versions (it finished its steps while no driver watched: the
    learner actor is detached and outlives a killed driver) is not trained on, but the rows it holds past
    ``written`` are still fetched and written before returning."""
    steps, generation, cursor, newest, finished = recipe.learner.num_steps, None, 0, -1, False
    rollout_time = RolloutTimeDeltas()  # time/rollout/*: the fleet's phase seconds since the previous written row
    while True:
        sup.tick()
        learner = sup.learner.handle
        try:
            if generation != sup.learner_generation:  # first pass, or the learner was restarted
                generation, cursor = sup.learner_generation, 0
                info = ray.get(learner.describe.remote(), timeout=30)
                remaining = steps - info.version
                if not info.running and remaining > 0:
                    learner.run.remote(remaining)
                finished = remaining <= 0
            rows, done, error = ray.get(learner.progress.remote(cursor), timeout=30)
        except (RayActorError, GetTimeoutError) as exc:  # the next tick restarts it
            log.warning("learner_unreachable", error=str(exc)[:200])
            time.sleep(poll_s)
            continue
        described = {s.name: s.info for s in sup.rollouts() if s.info is not None}
        tokens_per_s = sum(r.tokens_per_s for r in described.values())
        fresh = [row for row in rows if not (generation == 0 and row["step"] <= written)]
        rollout_s = spread(rollout_time.take({n: r.stats for n, r in described.items()}), len(fresh)) if fresh else {}
        for row in fresh:
            row.update(rollout_tokens_per_s=tokens_per_s, learner_restarts=sup.learner.restarts,
                       rollout_versions=[s.version for s in sup.rollouts()],
                       rollout_reward_means=merge_reward_means([r.stats for r in described.values()]), **rollout_s)
            metrics.write(row)
            progress.update(row)
        newest = max([newest, *(r["step"] for r in rows)])
        cursor += len(rows)
        if evals is not None:
            evals.poll(sup, newest)
        if error is not None:
            raise RuntimeError(f"the learner failed:\n{error}")
        if done or finished:
            return ray.get(learner.version.remote())
        time.sleep(poll_s)
