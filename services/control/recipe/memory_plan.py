"""The learner's memory in ``gyre run --dry-run``: which ZeRO stages fit one rank's GPU, from the recipe alone.

The arithmetic is ``learner.memory_estimate``; this module finds its inputs in a recipe — the model's config
numbers (no weights, nothing downloaded), the micro-batch's tokens, the GPU's memory and vLLM's share of it —
and says which stages fit, with ``HEADROOM``, and which one to prefer.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from gyre.learner.memory_estimate import GIB, MemoryEstimate, ModelShape, estimate, model_shape
from gyre.services.control.recipe.schema import Recipe
from gyre.utils.model_source import is_hub_id

DEFAULT_GPU_GIB = 80.0
"""GPU memory assumed when the recipe names no GPU type (an 80 GB A100/H100)."""

HEADROOM = 0.10
"""Fraction of the learner's share of a GPU left free: CUDA context, allocator fragmentation, what the estimate
leaves out. A stage fits when its estimate is at most ``(1 - HEADROOM)`` of that share."""

GPU_MEMORY_GIB: dict[str, float] = {
    "T4": 16, "V100": 16, "A10G": 24, "L4": 24, "L40S": 48, "A100": 40, "A100-40G": 40, "A100-80G": 80,
    "H100": 80, "H20": 96, "H200": 141, "B200": 180, "RTX-PRO-6000": 96, "AMD-Instinct-MI300X-OAM": 192,
}
"""Nominal memory per device of Ray's ``accelerator_type`` names (``ray.util.accelerators``). Plain ``A100`` (what
Ray labels both sizes) is taken as the 40 GB part; name ``A100-80G`` for the other."""

QWEN25_15B = {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
              "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True}
KNOWN_CONFIGS: dict[str, dict] = {"Qwen/Qwen2.5-1.5B-Instruct": QWEN25_15B, "Qwen/Qwen2.5-1.5B": QWEN25_15B}
"""The ``config.json`` numbers of the shipped GPU recipes' Hub models, for a dry run on a machine whose HF cache
lacks them (a dry run downloads nothing). A model's own ``config.json``, when readable, always wins."""


def read_model_config(recipe: Recipe) -> tuple[dict | None, str]:
    """``(config.json dict, where it came from)`` of the recipe's model without downloading anything: the model
    folder's file, else the HF cache's copy of the Hub id, else ``KNOWN_CONFIGS``; ``(None, why)`` when none is
    at hand.

    Raises:
        ValueError: a ``config.json`` that is not a JSON object (names the file).
    """
    hub_id = recipe.model_id or (recipe.model if is_hub_id(recipe.model) else None)
    path = Path(recipe.model) / "config.json"
    if not path.is_file() and hub_id is not None:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(hub_id, "config.json", revision=recipe.model_revision)
        path = Path(cached) if isinstance(cached, str) else path
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path} holds a {type(config).__name__}, expected a JSON object")
        return config, f"{path}"
    if hub_id in KNOWN_CONFIGS:
        return KNOWN_CONFIGS[hub_id], ("gyre's copy of its config.json numbers: not in the HF cache, a dry run "
                                       "downloads nothing")
    if hub_id is not None:
        return None, (f"{hub_id} is not in the HF cache and a dry run downloads nothing (`hf download {hub_id} "
                      "config.json` puts its config there)")
    return None, f"{path} does not exist"


def micro_batch_tokens(recipe: Recipe) -> tuple[int, str]:
    """``(tokens of one micro-batch on a rank, what set it)``: ``learner.engine.micro_batch_tokens``, else
    ``micro_batch_size`` rows times the longest row a rollout can return (``rollout.engine.max_model_len``,
    prompt + response: vLLM stops a request there), rows being padded to the longest."""
    e, longest = recipe.learner.engine, recipe.rollout.engine.max_model_len
    if e.micro_batch_tokens is not None:
        return e.micro_batch_tokens, "learner.engine.micro_batch_tokens"
    return e.rows_per_micro_batch * longest, (f"learner.engine.micro_batch_size {e.rows_per_micro_batch} × the longest row, "
                                          f"rollout.engine.max_model_len {longest}")


def gpu_memory(recipe: Recipe) -> tuple[float, str]:
    """``(GiB of one learner GPU, how it was chosen)``: the GPU type the learner's placement asks Ray for
    (a ``accelerator_type:<type>`` resource, ``GPU_MEMORY_GIB``), else ``DEFAULT_GPU_GIB``."""
    types = [k.split(":", 1)[1] for k in recipe.placement.learner.resources if k.startswith("accelerator_type:")]
    known = [t for t in types if t in GPU_MEMORY_GIB]
    if known:
        return GPU_MEMORY_GIB[known[0]], f"{known[0]}, {GPU_MEMORY_GIB[known[0]]:g} GiB (placement.learner.resources)"
    why = (f"accelerator_type {types[0]!r} is not one gyre knows ({', '.join(GPU_MEMORY_GIB)})" if types else
           "the recipe names no GPU type; placement.learner.resources {\"accelerator_type:H100\": 0.001} names one")
    return DEFAULT_GPU_GIB, f"{DEFAULT_GPU_GIB:g} GiB assumed ({why})"


def vllm_share(recipe: Recipe, shape: ModelShape, gpu_bytes: int) -> tuple[int, str]:
    """``(bytes vLLM takes on a learner GPU, why)``. Rollouts share a learner's GPU only when the placement gives
    both roles a fraction of one (``placement.learner.num_gpus`` and ``placement.rollout.num_gpus`` below 1,
    adding up to at most 1): then each of the rollouts that fit beside the learner takes its
    ``gpu_memory_utilization`` × the GPU (or, with ``kv_cache_gib``, its weights plus that cache)."""
    pl, e = recipe.placement, recipe.rollout.engine
    lf, rf = pl.learner.num_gpus, pl.rollout.num_gpus
    if e.kind != "vllm":
        return 0, f"rollouts run no vLLM (rollout.engine.kind {e.kind})"
    if not (0 < lf < 1 and 0 < rf < 1 and lf + rf <= 1):
        return 0, f"rollouts on GPUs of their own, placement num_gpus: learner {lf:g}, rollout {rf:g}"
    beside = min(recipe.rollout.num_workers, math.floor((1 - lf) / rf + 1e-9))
    if e.kv_cache_gib is not None:
        weight_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[e.dtype]
        one = shape.params * weight_bytes + int(e.kv_cache_gib * GIB)
        how = f"weights + kv_cache_gib {e.kv_cache_gib:g}"
    else:
        one, how = int(e.gpu_memory_utilization * gpu_bytes), f"gpu_memory_utilization {e.gpu_memory_utilization:g}"
    return beside * one, (f"{beside} rollout(s) beside each learner rank, placement num_gpus: learner {lf:g}, "
                          f"rollout {rf:g}; each takes its {how}")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The learner's memory per rank under each ZeRO stage, and the GPU share it must fit in."""

    by_stage: dict[int, MemoryEstimate]
    """ZeRO stage 0-3 -> its estimate, with the recipe's offload setting (none at stage 0)."""
    stage: int
    """The recipe's ``learner.engine.zero_stage``."""
    budget: int
    """Bytes a rank may use: ``(1 - HEADROOM)`` × (GPU memory - vLLM's share)."""
    offloaded: MemoryEstimate
    """ZeRO-3 with ``offload_optimizer: cpu``: the last resort when no stage fits."""
    on_gpu: MemoryEstimate
    """The recipe's stage with the optimizer on the GPU (``offload_optimizer: none``)."""

    def fits(self, stage: int) -> bool:
        """Whether ``stage``'s estimate is within ``budget``."""
        return self.by_stage[stage].total <= self.budget

    def advice(self) -> str | None:
        """One line when the recipe should change: its stage does not fit; it is ZeRO-3 where ZeRO-2 fits (ZeRO-0
        to 2 reduce the same gradient volume, only ZeRO-3 adds collectives); it offloads an optimizer the GPU
        could hold. ``None`` when it should not."""
        gib = lambda n: f"{n / GIB:.3g} GiB"  # noqa: E731
        mine = self.by_stage[self.stage]
        if self.fits(self.stage):
            if self.stage == 3 and self.fits(2):
                return (f"recommend ZeRO-2 (learner.engine.zero_stage: 2): it fits ({gib(self.by_stage[2].total)}), "
                        "and ZeRO-3 re-gathers every layer's parameters in each forward and again in backward "
                        "(~1.5x ZeRO-2's traffic); ZeRO-0 to 2 reduce the same gradient volume")
            if mine.host and self.on_gpu.total <= self.budget:
                return (f"recommend offload_optimizer: none: ZeRO-{self.stage} fits without it "
                        f"({gib(self.on_gpu.total)}), and the offloaded optimizer step runs on the host's cores")
            return None
        fitting = [s for s in (2, 3, 1, 0) if self.fits(s)]
        if fitting:
            return (f"ZeRO-{self.stage} does not fit ({gib(mine.total)} > {gib(self.budget)}): use "
                    f"ZeRO-{fitting[0]} ({gib(self.by_stage[fitting[0]].total)})")
        if self.offloaded.total <= self.budget:
            return (f"no stage fits in {gib(self.budget)}: ZeRO-3 with offload_optimizer: cpu does "
                    f"({gib(self.offloaded.total)} on the GPU, {gib(self.offloaded.host)} of host memory per rank)")
        return (f"no stage fits in {gib(self.budget)}, offloaded or not: more ranks (placement.learner.world_size), "
                "a smaller micro-batch, or gradient_checkpointing: true")


def memory_lines(recipe: Recipe) -> list[str]:
    """The dry run's ``memory`` block: the model, one rank's estimate by part, the GPU share, each stage's fit and
    at most one line of advice (``MemoryPlan.advice``). A model whose config cannot be read gives one line saying
    why; a CPU learner gets its estimate and no fit."""
    try:
        config, source = read_model_config(recipe)
        shape = model_shape(config) if config is not None else None
    except ValueError as exc:
        return [f"memory     not estimated: {exc}"]
    if shape is None:
        return [f"memory     not estimated: no config.json of the model at hand ({source})"]
    e, world = recipe.learner.engine, recipe.placement.learner.world_size
    tokens, tokens_how = micro_batch_tokens(recipe)

    def at(stage: int, offload: str = e.offload_optimizer) -> MemoryEstimate:
        return estimate(shape, zero_stage=stage, dtype=e.dtype, world_size=world, tokens=tokens,
                        gradient_checkpointing=e.gradient_checkpointing, logits_chunk=e.logits_chunk,
                        offload_optimizer=offload, reference_model=recipe.learner.algorithm.kl_coef > 0)

    by_stage = {s: at(s) for s in range(4)}
    mine, pad = by_stage[e.zero_stage], " " * 12
    lines = [
        f"memory     learner per rank (learner.memory_estimate): {_count(shape.params)} parameters, "
        f"{shape.layers} layers × hidden {shape.hidden}, vocab {shape.vocab} ({source})",
        f"{pad}ZeRO-{e.zero_stage} {e.dtype} over {world} rank{'s' if world > 1 else ''}: " + _parts(mine),
        f"{pad}activations at {tokens} tokens per micro-batch ({tokens_how}), "
        + ("gradient checkpointing" if e.gradient_checkpointing else "no gradient checkpointing")
        + f"; logits {e.logits_chunk} tokens × {shape.vocab} × 4 B (learner.engine.logits_chunk)",
    ]
    if recipe.placement.learner.num_gpus == 0:
        return lines + [f"{pad}the learner runs on CPU (placement.learner.num_gpus 0): host memory, no GPU to fit"]
    gpu_gib, gpu_how = gpu_memory(recipe)
    vllm, vllm_how = vllm_share(recipe, shape, int(gpu_gib * GIB))
    budget = max(0, int((1 - HEADROOM) * (gpu_gib * GIB - vllm)))
    plan = MemoryPlan(by_stage=by_stage, stage=e.zero_stage, budget=budget, offloaded=at(3, "cpu"),
                      on_gpu=at(e.zero_stage, "none"))
    advice = plan.advice()
    return lines + [
        f"{pad}GPU {gpu_how}; vLLM {_gib(vllm)} GiB: {vllm_how}; a rank fits in {_gib(plan.budget)} GiB "
        f"({HEADROOM:.0%} headroom)",
        pad + " · ".join(f"ZeRO-{s} {_gib(m.total)} {'fits' if plan.fits(s) else 'does not fit'}"
                         for s, m in by_stage.items()),
        *([pad + advice] if advice else [])]


def _parts(m: MemoryEstimate) -> str:
    """``weights 2.88 + gradients 2.37 + ... = 14.7 GiB`` (and the host's share when offloaded)."""
    parts = [("weights", m.weights), ("gradients", m.gradients), ("optimizer", m.optimizer),
             ("activations", m.activations), ("logits", m.logits)] + ([("reference model", m.reference)]
                                                                     if m.reference else [])
    host = f"; optimizer {_gib(m.host)} GiB in host memory" if m.host else ""
    return " + ".join(f"{name} {_gib(n)}" for name, n in parts) + f" = {_gib(m.total)} GiB" + host


def _gib(n: int) -> str:
    """Bytes as GiB to three significant digits: ``14.7``, ``0.58``."""
    return f"{n / GIB:.3g}"


def _count(n: int) -> str:
    """``1.54 B``, ``135 M``, ``2.29 M``: a parameter count at a glance."""
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M" if n >= 1e6 else str(n)
