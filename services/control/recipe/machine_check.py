"""Whether this install and machine can run a recipe (``gyre run``, before anything starts)."""

from __future__ import annotations

from gyre.services.control.recipe.schema import Recipe, RecipeError


def check_machine(recipe: Recipe, cuda_devices: int | None = None) -> None:
    """Refuse, before anything starts, a recipe this install or machine cannot run: vLLM rollouts with no
    engine installed (a base install), a fleet larger than the broadcast group takes (``weight_transport: nccl``),
    ``backend: nccl`` on a private local Ray without a GPU, GPUs asked for (``placement``) with the cpu target installed, or, for a private local Ray
    (``ray.address: local``), more GPUs than this machine has. On a cluster the GPUs are the nodes', not
    this driver's, and are left to Ray's placement.

    Args:
        cuda_devices: GPUs on this machine (``None``: ``torch.cuda.device_count()``).

    Raises:
        RecipeError: naming the setting that asks for GPUs, what this machine or install has, and the fix.
    """
    from gyre.rollout.install_check import installed_target

    need = recipe.gpus_needed
    nccl = recipe.rollout.engine.weight_transport.type == "nccl"
    target = installed_target()
    if target is None and recipe.rollout.engine.kind == "vllm":
        raise RecipeError(f"recipe {recipe.name} runs vLLM rollouts, but no inference engine is installed (a base "
                          "install): add a target, `pip install --no-deps -r requirements/cpu.lock` or "
                          "requirements/cuda.lock (or `make setup`)")
    if nccl:
        check_broadcast_group(recipe, cuda_devices)
    if not need:
        return
    what = ", ".join(f"{role} {n:g}" for role, n in need.items()) or "none"
    asks = f"recipe {recipe.name} asks for GPUs (placement: {what})"
    if target != "cuda":
        raise RecipeError(f"{asks}, but this environment has the {target or 'base (no engine)'} target: install "
                          "the cuda target (`make setup GYRE_TARGET=cuda` or `pip install --no-deps -r "
                          "requirements/cuda.lock`) on a CUDA machine, or run a CPU recipe")
    if recipe.ray.address == "local":
        if cuda_devices is None:
            import torch

            cuda_devices = torch.cuda.device_count()
        total = sum(need.values())
        if total > cuda_devices:
            raise RecipeError(f"{asks}: {total:g} in all, but this machine has {cuda_devices} CUDA device(s): "
                              "lower placement.*.num_gpus / rollout.num_workers / placement.learner.world_size, "
                              "or run on a cluster (ray.address: auto)")


def check_broadcast_group(recipe: Recipe, cuda_devices: int | None = None) -> None:
    """Refuse a ``weight_transport: nccl`` recipe whose fleet is larger than the group takes (``max_members``), or
    that asks for ``backend: nccl`` on a private local Ray (``ray.address: local``) with no CUDA device here.

    Raises:
        RecipeError: naming both numbers (or the backend) and the fix.
    """
    transport = recipe.rollout.engine.weight_transport
    fleet = recipe.rollout.num_workers
    if fleet > transport.max_members:
        raise RecipeError(f"recipe {recipe.name}: rollout.num_workers ({fleet}) is more than the broadcast group takes "
                          f"(rollout.engine.weight_transport.max_members: {transport.max_members}): raise max_members "
                          "to at least the fleet, or use weight_transport type 'grpc' with relay_fanout: 8")
    if transport.backend == "nccl" and recipe.ray.address == "local":
        if cuda_devices is None:
            import torch

            cuda_devices = torch.cuda.device_count()
        if cuda_devices == 0:
            raise RecipeError(f"recipe {recipe.name}: rollout.engine.weight_transport.backend 'nccl' needs CUDA GPUs, "
                              "but this machine has none: use backend 'auto' (gloo here) or 'gloo'")
