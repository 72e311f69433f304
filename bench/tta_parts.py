"""``bench.time_to_accuracy``'s pure parts: the arms' settings from one recipe, and the arithmetic from
accuracy curves to the two ratios. No training, no vLLM, no TRL import (the unit tests run them as is).

A *curve* is ``[[wall_s, accuracy], ...]``: training wall-clock seconds since the arm was launched (evaluation
excluded) at which a policy was saved, and that policy's held-out greedy accuracy in [0, 1] from ``gyre eval``;
the first point is ``[0.0, initial accuracy]`` (the untrained model, shared by every arm), times increase.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "deploy/recipes/smollm2-arith.yaml"
"""The default recipe (``make run``): SmolLM2-135M-Instruct on 2-term 1–2 digit +/− arithmetic."""
SMOLLM2 = REPO / ".cache/models/SmolLM2-135M-Instruct"
ARMS = ("gyre_async", "gyre_sync", "trl")


@dataclass(frozen=True)
class Scale:
    """How long each arm trains and how often it is evaluated."""

    steps: int
    """Optimizer steps per arm (gyre ``learner.num_steps``, TRL ``max_steps``)."""
    eval_every: int
    """Steps between saved policies (gyre ``learner.save_interval``, TRL ``save_steps``); each is scored."""
    overrides: dict
    """Recipe overrides on top of the default recipe (dotted keys), the same for every arm."""


FULL = Scale(steps=100, eval_every=10, overrides={})
QUICK = Scale(steps=4, eval_every=2, overrides={
    "rollout.group_size": 4, "rollout.groups_in_flight": 2, "rollout.max_ready_groups": 2,
    "rollout.sampling.max_new_tokens": 16, "rollout.engine.kv_cache_gib": 0.25, "rollout.engine.max_num_seqs": 8,
    "learner.groups_per_step": 2, "learner.engine.lr": 1.0e-4,
    "task.heldout_size": 8})
"""A tiny random Llama (``tests/tiny_model.py``), 4 steps of 2 prompts × 4 samples, 8 held-out problems: the
pipeline end to end in minutes on 2 cores. Its accuracy is ~0, so its ratios are usually ``null``."""


def arm_overrides(model: str, run_dir: str, arm: str, scale: Scale) -> dict:
    """Recipe overrides for one arm: the scale's, plus checkpoints every ``eval_every`` steps (all kept),
    no in-run evaluation (the bench scores every saved policy with ``gyre eval`` afterwards) and, for
    ``gyre_sync``, ``rollout.max_groups_per_version = learner.groups_per_step`` (each policy version
    generates exactly one step's groups: the next batch waits for the weights of the step before it).
    ``trl`` takes the same recipe (its settings are read from it: ``trl_settings``).

    Raises:
        ValueError: an unknown ``arm``.
    """
    if arm not in ARMS:
        raise ValueError(f"arm {arm!r} is not one of {ARMS}")
    out = {"model": model, "run_dir": run_dir, "name": arm, "ray.num_cpus": 2, "eval_before": False,
           "eval_after": False, "learner.num_steps": scale.steps, "learner.save_interval": scale.eval_every,
           "learner.keep_last_n": scale.steps // scale.eval_every + 1, **scale.overrides}
    if arm == "gyre_sync":
        from gyre.services.control.recipe.schema import load_recipe

        groups = scale.overrides.get("learner.groups_per_step") or load_recipe(RECIPE).learner.groups_per_step
        out["rollout.max_groups_per_version"] = groups
    return out


def shared_settings(recipe) -> dict:
    """What must match across arms, read from a loaded gyre ``Recipe``: learning rate, group size, prompts
    and samples per step, response-token budget, sampling temperature/top-p, KL coefficient, grad clip,
    the reward's version, the task, its seeds and held-out size."""
    from gyre.rollout.tasks import reward_configs

    comp = recipe.task.components()
    (task, component), = comp.items()
    rewards = reward_configs(task, component)
    return {"lr": recipe.learner.engine.lr, "group_size": recipe.rollout.group_size,
            "prompts_per_step": recipe.learner.groups_per_step,
            "samples_per_step": recipe.learner.groups_per_step * recipe.rollout.group_size,
            "max_new_tokens": recipe.rollout.sampling.max_new_tokens,
            "temperature": recipe.rollout.sampling.temperature, "top_p": recipe.rollout.sampling.top_p,
            "kl_coef": recipe.learner.algorithm.kl_coef, "grad_clip": recipe.learner.engine.grad_clip,
            "reward": [r.label for r in rewards],
            "task": task, "task_seed": recipe.task.seed, "heldout_seed": recipe.task.heldout_seed,
            "heldout_size": recipe.task.heldout_size, "steps": recipe.learner.num_steps,
            "eval_every": recipe.learner.save_interval}


def trl_settings(recipe, output_dir: str) -> dict:
    """``GRPOConfig`` keyword arguments matching ``recipe`` (a plain dict: no TRL import here).

    One TRL optimizer step trains on ``groups_per_step`` prompts × ``group_size`` samples, generated once
    (``generation_batch_size``), in micro-batches of the learner's ``micro_batch_size`` (gradient
    accumulation makes up the rest; with a token budget, ``micro_batch_tokens``, the step's rows in one padded
    micro-batch: TRL counts rows, and the default recipe's budget holds a whole step), one pass (``num_iterations=1``); clip range, KL coefficient, grad clip,
    constant learning rate without warm-up, sampling settings as gyre's. TRL's documented CPU path:
    ``use_cpu=True``, bf16 off, transformers generation (``use_vllm=False``). Prompts in the dataset's order
    (``shuffle_dataset=False``: gyre leases prompt indices 0, 1, 2, ...).

    Raises:
        ValueError: ``micro_batch_size`` does not divide the samples per step (TRL needs whole micro-batches).
    """
    s = shared_settings(recipe)
    engine = recipe.learner.engine
    per_micro = s["samples_per_step"] if engine.micro_batch_tokens is not None else engine.rows_per_micro_batch
    micro = min(per_micro, s["samples_per_step"])
    if s["samples_per_step"] % micro:
        raise ValueError(f"learner.engine.micro_batch_size ({micro}) must divide the samples per step "
                         f"({s['samples_per_step']}) for TRL's gradient accumulation")
    algo = recipe.learner.algorithm
    return {"output_dir": output_dir, "learning_rate": s["lr"], "lr_scheduler_type": "constant",
            "warmup_steps": 0, "weight_decay": recipe.learner.engine.weight_decay,
            "adam_beta1": recipe.learner.engine.betas[0], "adam_beta2": recipe.learner.engine.betas[1],
            "adam_epsilon": recipe.learner.engine.adam_eps, "max_grad_norm": s["grad_clip"],
            "num_generations": s["group_size"], "per_device_train_batch_size": micro,
            "gradient_accumulation_steps": s["samples_per_step"] // micro,
            "generation_batch_size": s["samples_per_step"], "num_iterations": 1,
            "max_completion_length": s["max_new_tokens"], "temperature": s["temperature"], "top_p": s["top_p"],
            "beta": s["kl_coef"], "epsilon": algo.clip_eps_low, "epsilon_high": algo.clip_eps_high,
            "max_steps": s["steps"], "save_strategy": "steps", "save_steps": s["eval_every"],
            "save_only_model": True, "shuffle_dataset": False, "use_vllm": False, "use_cpu": True,
            "bf16": False, "seed": recipe.seed, "logging_steps": 1, "report_to": [], "disable_tqdm": True}


def trl_shared_settings(trl: dict, recipe) -> dict:
    """``shared_settings``' keys as the TRL arm will run them, read back from its ``GRPOConfig`` kwargs
    (task, seeds and reward are the recipe's: the TRL arm builds its prompts and reward from it)."""
    samples = trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"]
    return {**shared_settings(recipe), "lr": trl["learning_rate"], "group_size": trl["num_generations"],
            "prompts_per_step": trl["generation_batch_size"] // trl["num_generations"], "samples_per_step": samples,
            "max_new_tokens": trl["max_completion_length"], "temperature": trl["temperature"],
            "top_p": trl["top_p"], "kl_coef": trl["beta"], "grad_clip": trl["max_grad_norm"],
            "steps": trl["max_steps"], "eval_every": trl["save_steps"]}


# ---- curves → ratios -------------------------------------------------------------------------------------
def check_curve(curve: list) -> None:
    """Raise ``ValueError`` naming the bad point unless ``curve`` is non-empty, its times are ≥ 0 and
    strictly increasing and its accuracies lie in [0, 1]."""
    if not curve:
        raise ValueError("curve is empty")
    for i, (t, acc) in enumerate(curve):
        if t < 0 or (i and t <= curve[i - 1][0]):
            raise ValueError(f"curve point {i} time {t} s must be >= 0 and after {curve[i - 1][0] if i else 0} s")
        if not 0.0 <= acc <= 1.0:
            raise ValueError(f"curve point {i} accuracy {acc} is outside [0, 1]")


def time_to_reach(curve: list, target: float) -> float | None:
    """Wall seconds of the first evaluated point whose accuracy is ≥ ``target`` (first crossing, no
    interpolation: accuracy is only known where a policy was scored); ``None`` if no point reaches it."""
    check_curve(curve)
    return next((float(t) for t, acc in curve if acc >= target), None)


def time_ratio(reference: list, other: list) -> tuple[float | None, str | None]:
    """``(ratio, note)``: ``reference``'s seconds to its own final accuracy ÷ ``other``'s seconds to that
    accuracy (> 1: ``other`` gets there faster). ``(None, why)`` when undefined: the final accuracy is 0 or
    no better than the start (reached at 0 s), or ``other`` never reaches it."""
    target = float(reference[-1][1])
    t_ref = time_to_reach(reference, target)
    t_other = time_to_reach(other, target)
    if target <= 0.0:
        return None, "final accuracy is 0: every curve reaches it at 0 s"
    if t_ref == 0.0:
        return None, f"final accuracy {target:.3f} is no better than at 0 s (no learning to time)"
    if t_other is None:
        return None, f"never reached the reference's final accuracy {target:.3f}"
    if t_other == 0.0:
        return None, f"already at {target:.3f} at 0 s"
    return t_ref / t_other, None


def ratios(curves: dict[str, list]) -> dict:
    """``async_over_sync`` = ``time_ratio(sync, async)`` and ``trl_over_gyre`` = ``time_ratio(trl, async)``
    (rounded to 3 places), each with a ``*_note`` that is ``None`` unless the ratio is ``None``."""
    out = {}
    for key, ref in (("async_over_sync", "gyre_sync"), ("trl_over_gyre", "trl")):
        ratio, note = time_ratio(curves[ref], curves["gyre_async"])
        out[key], out[f"{key}_note"] = (None if ratio is None else round(ratio, 3)), note
    return out
