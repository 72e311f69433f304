"""Human-readable resolved plan of a recipe (``gyre run --dry-run``)."""

from __future__ import annotations

from gyre.utils.model_source import is_hub_id
from gyre.services.control.recipe.memory_plan import memory_lines
from gyre.services.control.recipe.schema import Recipe
from gyre.services.control.recipe.recorded import rollouts_to_start


def _task_line(recipe: Recipe) -> str:
    """``name params``, ``dataset PATH split=S columns={..}`` or the mixture's tasks and weights."""
    t = recipe.task
    if t.dataset is not None:
        return f"dataset {t.dataset.path} split={t.dataset.split} columns={t.dataset.columns.model_dump()}"
    if t.mixture is not None:
        return "mixture " + " ".join(f"{n}={c.weight}" for n, c in t.mixture.items())
    return f"{t.name} {t.params}"


def describe(recipe: Recipe) -> str:
    """Services, their key settings and the derived batch sizes, the learner's memory per rank
    (``memory_plan.memory_lines``), one screen."""
    r, l, rp = recipe.rollout, recipe.learner, recipe.replay
    batch = l.groups_per_step * r.group_size
    lines = [
        f"run {recipe.name}  →  {recipe.out_dir}",
        f"model      {_model_line(recipe)}",
        f"task       {_task_line(recipe)}  (held-out {recipe.task.heldout_size}, seed {recipe.task.heldout_seed})",
        f"ray        address={recipe.ray.address} namespace={recipe.ray.namespace}",
        "services",
        f"  replay    max_staleness={rp.max_staleness} capacity_groups={rp.capacity_groups} lease_ttl_s={rp.lease_ttl_s}"
        if rp.source is None else f"  replay    a copy of the recording {rp.source.recorded}: the groups its learner "
        "consumed, in that order, no staleness gate; rollouts only evaluate",
        f"  learner   DeepSpeed ZeRO-{l.engine.zero_stage} {l.engine.dtype} lr={l.engine.lr} "
        f"{_micro_batch(l.engine)}{' grad-checkpointing' if l.engine.gradient_checkpointing else ''}"
        f"  steps={l.num_steps}",
        f"            batch = {l.groups_per_step} groups × {r.group_size} samples = {batch} trajectories/step",
        f"            loss: decoupled PPO-clip (ε={l.algorithm.clip_eps_low}/{l.algorithm.clip_eps_high}) × TIS (C={l.algorithm.tis_cap})",
        f"  rollout×{rollouts_to_start(recipe)} vLLM {r.engine.dtype} max_model_len={r.engine.max_model_len} "
        f"{_kv_line(r.engine)}; n={r.group_size}, {r.groups_in_flight} groups in flight, "
        f"T={r.sampling.temperature} max_new_tokens={r.sampling.max_new_tokens}",
        _eval_line(recipe),
        f"outputs    metrics.jsonl, reward_accuracy.png, checkpoints/global_step_{l.num_steps}/, final_policy/",
        f"tracking   {', '.join(recipe.tracking.enabled()) or 'none'}",
        f"resume     {l.resume}{' (forced)' if l.force_resume else ''}",
        (f"determinism lockstep: prompt i generated with policy version max(0, i // {l.groups_per_step} - "
         f"{recipe.lockstep_lag}); versions in {l.lockstep.weights_dir}" if l.lockstep is not None
         else "determinism async (bounded staleness)"),
        *([f"faults     {recipe.faults}"] if recipe.faults else []),
        *memory_lines(recipe),
        *placement_lines(recipe),
    ]
    return "\n".join(lines)


def _micro_batch(e) -> str:
    """``micro_batch_tokens=N`` (a token budget per rank) or ``micro_batch=N`` (rows)."""
    return f"micro_batch_tokens={e.micro_batch_tokens}" if e.micro_batch_tokens is not None else \
        f"micro_batch={e.rows_per_micro_batch}"


def _model_line(recipe: Recipe) -> str:
    if recipe.model_id is not None:  # resolved: the HF-cache folder and the pinned commit
        return f"{recipe.model_id}@{recipe.model_revision}  ({recipe.model})"
    if is_hub_id(recipe.model):  # dry run: nothing downloaded
        at = f"@{recipe.model_revision}" if recipe.model_revision else " (default branch)"
        return f"{recipe.model}{at}  (Hugging Face Hub id; downloaded into the HF cache when the run starts)"
    return recipe.model


def _kv_line(e) -> str:
    """vLLM memory settings as each device resolves them (``EngineConfig.device_settings``)."""
    eager = lambda cuda: e.device_settings(cuda)["enforce_eager"]  # noqa: E731
    kv = f"kv_cache={e.kv_cache_gib:g} GiB" if e.kv_cache_gib is not None else \
        f"kv_cache=1 GiB on CPU, gpu_memory_utilization={e.gpu_memory_utilization:g} on CUDA"
    return f"{kv} tensor_parallel={e.tensor_parallel_size} enforce_eager={eager(False)} on CPU/{eager(True)} on CUDA"


def _resources(p) -> str:
    extra = "".join(f" {k}={v:g}" for k, v in sorted(p.resources.items()))
    if p.cpus is not None:  # services.common.cpus: bound to these cores, as many torch/OpenMP threads
        extra += f" cpus={p.cpus if isinstance(p.cpus, str) else '|'.join(p.cpus)}"
    return f"num_cpus={p.num_cpus:g} num_gpus={p.num_gpus:g}{extra}"


def placement_lines(recipe: Recipe) -> list[str]:
    """Where each service will land: its Ray actor name, resources and (learner) placement group."""
    pl, run = recipe.placement, recipe.name
    ns = recipe.ray.namespace
    learner = f"  gyre:{run}:learner  ×1  {_resources(pl.learner)}"
    if pl.learner.world_size > 1:
        learner += (f"  world_size={pl.learner.world_size} placement group {pl.learner.strategy} "
                    f"bundles={pl.learner.bundles()}")
    return [f"placement  detached actors in namespace {ns!r} on Ray at {recipe.ray.address}",
            f"  gyre:{run}:replay   ×1  {_resources(pl.replay)}" if recipe.replay.shards == 1 else
            f"  gyre:{run}:replay, replay-shard-k  ×{recipe.replay.shards}  {_resources(pl.replay)} each, "
            f"prompt i in shard i mod {recipe.replay.shards}",
            learner,
            f"  gyre:{run}:rollout-i ×{recipe.rollout.num_workers}  {_resources(pl.rollout)}"
            + (f"  spool {recipe.rollout.spool_dir}/rollout-i" if recipe.rollout.spool_dir else ""),
            *([f"  gyre:{run}:reward_model ×1  {_resources(pl.reward_model)}  "
               + ", ".join(f"{m['kind']} {m['model']}" for m in recipe.model_rewards())]
              if recipe.model_rewards() else []),
            f"security   bind {recipe.security.bind_host} tls={recipe.security.tls} "
            f"token={'yes' if recipe.security.has_token else 'generated per run' if recipe.security.needs_run_token else 'no'}"]


def _eval_line(recipe: Recipe) -> str:
    """When and how the held-out sets are evaluated (``recipe.eval``)."""
    e = recipe.eval
    when = [w for w, on in (("before", e.before), (f"every {e.every_steps} steps", e.every_steps), ("after", e.after))
            if on]
    how = f"greedy + k={e.n_samples} samples at T={e.temperature:g} (mean@k, pass@k)" if e.n_samples else "greedy"
    return (f"evaluation {', '.join(when) or 'never'} on {', '.join(e.sets) if e.sets else 'all held-out sets'}: "
            f"{how}, max_new_tokens={e.max_new_tokens}; completions in eval/step_N.jsonl")
