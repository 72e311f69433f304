"""Human-readable resolved plan of a recipe (``gyre run --dry-run``)."""

from __future__ import annotations

from services.recipe import Recipe


def describe(recipe: Recipe) -> str:
    """Services, their key settings and the derived batch sizes, one screen."""
    r, l, rp = recipe.rollout, recipe.learner, recipe.replay
    batch = l.groups_per_step * r.group_size
    lines = [
        f"run {recipe.name}  →  {recipe.out_dir}",
        f"model      {recipe.model}",
        f"task       {recipe.task.name} {recipe.task.params}  (held-out {recipe.task.heldout_size}, seed {recipe.task.heldout_seed})",
        f"ray        address={recipe.ray.address} namespace={recipe.ray.namespace}",
        "services",
        f"  replay    max_staleness={rp.max_staleness} capacity_groups={rp.capacity_groups} lease_ttl_s={rp.lease_ttl_s}",
        f"  learner   DeepSpeed ZeRO-{l.engine.zero_stage} {l.engine.dtype} lr={l.engine.lr} "
        f"micro_batch={l.engine.micro_batch_size}  steps={l.num_steps}",
        f"            batch = {l.groups_per_step} groups × {r.group_size} samples = {batch} trajectories/step",
        f"            loss: decoupled PPO-clip (ε={l.algorithm.clip_eps_low}/{l.algorithm.clip_eps_high}) × TIS (C={l.algorithm.tis_cap})",
        f"  rollout×{r.num_workers} vLLM {r.engine.dtype} max_model_len={r.engine.max_model_len} "
        f"kv_cache={r.engine.kv_cache_gib} GiB; n={r.group_size}, {r.groups_in_flight} groups in flight, "
        f"T={r.sampling.temperature} max_new_tokens={r.sampling.max_new_tokens}",
        f"evaluation greedy on held-out set: before={recipe.eval_before} after={recipe.eval_after}",
        f"outputs    metrics.jsonl, reward_accuracy.png, checkpoints/global_step_{l.num_steps}/, final_policy/",
    ]
    return "\n".join(lines)
