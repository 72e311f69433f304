"""Which Ray resources each node of a Slurm allocation advertises, from the recipe (``deploy/slurm.sbatch``).

A recipe pins roles to nodes with custom Ray resources (``placement.<role>.resources``, e.g. ``{gyre_learner: 1}``);
on a cluster that ``ray up`` starts, the node types declare them (``deploy/cluster.yaml``). On Slurm the nodes are
whatever the allocation holds, so the batch script asks this module what each node should declare, and starts
``ray start --num-gpus G --resources JSON`` with it. The layout:

- the head (node 0) holds replay (all its shards), the learner's ranks and the reward model; what GPUs the learner
  leaves there go to rollouts;
- every other node holds rollouts, as many as its GPUs fit (``placement.rollout.num_gpus`` each; rollouts without
  GPUs: no limit but the CPUs Ray counts).

A node advertises each role's resources times the number of that role's actors it can host, so ``gyre scale``
can grow the fleet up to what the nodes hold. A recipe without custom resources gets ``{}`` everywhere: only
``--num-gpus`` changes. A learner larger than one node is refused (its ranks on a second node would not commit
their checkpoint shards).

    python -m gyre.deploy.slurm_layout --nodes 3 --gpus-per-node 8 RECIPE [--set KEY=VALUE ...]          # the plan
    python -m gyre.deploy.slurm_layout --nodes 3 --gpus-per-node 8 --node 1 RECIPE [--set KEY=VALUE ...] # JSON

Exit status 2 with a message naming the numbers when the recipe does not fit the allocation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

UNBOUNDED = 1024
"""Actors a node advertises room for when the role takes no GPU (Ray's CPU count is then the real bound)."""


class LayoutError(ValueError):
    """The recipe does not fit the allocation; the message names the role, the numbers and the fix."""


@dataclass
class NodeLayout:
    """One node's share: ``roles`` (role → actors it can host) and the custom ``resources`` it advertises."""

    index: int
    gpus: float
    roles: dict[str, int] = field(default_factory=dict)
    resources: dict[str, float] = field(default_factory=dict)

    def host(self, role: str, count: int, resources: dict[str, float]) -> None:
        """Room for ``count`` actors of ``role``, each asking for ``resources``."""
        if count <= 0:
            return
        self.roles[role] = self.roles.get(role, 0) + count
        for name, amount in resources.items():
            self.resources[name] = self.resources.get(name, 0.0) + amount * count


def _room(gpus: float, per_actor: float) -> int:
    return UNBOUNDED if per_actor <= 0 else int(math.floor(gpus / per_actor + 1e-9))


def node_layouts(placement, replay_shards: int, rollouts: int, nodes: int, gpus_per_node: float,
                 reward_model: bool = False) -> list[NodeLayout]:
    """The layout of ``nodes`` nodes with ``gpus_per_node`` GPUs each for a recipe's ``placement``
    (``PlacementConfig``), its ``replay.shards`` and ``rollout.num_workers``; ``reward_model``: the recipe's reward
    names a model (``Recipe.model_rewards``), so a reward-model service runs.

    Raises:
        LayoutError: ``nodes < 1`` or ``gpus_per_node < 0``; the learner's ranks (``world_size × num_gpus``) or the
            reward model do not fit the head's GPUs; the nodes hold fewer rollouts than ``rollout.num_workers``.
    """
    if nodes < 1 or gpus_per_node < 0:
        raise LayoutError(f"{nodes} node(s) with {gpus_per_node} GPU(s) each: expected at least 1 node and >= 0 GPUs")
    layout = [NodeLayout(i, gpus_per_node) for i in range(nodes)]
    head, left = layout[0], float(gpus_per_node)
    learner = placement.learner
    need = learner.world_size * learner.num_gpus
    if need > left + 1e-9:
        raise LayoutError(f"placement.learner: world_size {learner.world_size} x num_gpus {learner.num_gpus:g} = "
                          f"{need:g} GPUs, but a node has {gpus_per_node:g}: the learner runs on the head node alone "
                          "(a learner across nodes is not supported yet); lower world_size or ask Slurm for nodes "
                          "with more GPUs (--gpus-per-node)")
    left -= need
    head.host("replay", replay_shards, dict(placement.replay.resources))
    head.host("learner", learner.world_size, dict(learner.resources))
    if reward_model:
        if placement.reward_model.num_gpus > left + 1e-9:
            raise LayoutError(f"placement.reward_model: num_gpus {placement.reward_model.num_gpus:g}, but the learner "
                              f"leaves {left:g} of the head's {gpus_per_node:g} GPUs")
        left -= placement.reward_model.num_gpus
        head.host("reward_model", 1, dict(placement.reward_model.resources))
    rollout = placement.rollout
    per_process = max(rollout.rollouts_per_process, 1)
    for node in layout:
        room = _room(left if node is head else gpus_per_node, rollout.num_gpus)
        node.host("rollout", room, dict(rollout.resources))
    processes = math.ceil(rollouts / per_process)
    room = sum(n.roles.get("rollout", 0) for n in layout)
    if processes > room:
        raise LayoutError(f"rollout.num_workers {rollouts} needs {processes} rollout process(es) with num_gpus "
                          f"{rollout.num_gpus:g} each, but {nodes} node(s) of {gpus_per_node:g} GPUs hold {room} "
                          f"after the learner's {need:g} GPUs on the head: ask Slurm for more nodes "
                          f"(sbatch --nodes={nodes + math.ceil((processes - room) / max(_room(gpus_per_node, rollout.num_gpus), 1))})")
    return layout


def describe(layout: list[NodeLayout]) -> str:
    """One line per node: its GPUs, the roles it hosts (how many) and the resources it advertises."""
    lines = []
    for node in layout:
        roles = ", ".join(f"{r} x{n}" if n < UNBOUNDED else f"{r} (no GPU limit)" for r, n in node.roles.items())
        lines.append(f"node {node.index}{' (head)' if node.index == 0 else ''}: {node.gpus:g} GPU(s); {roles or '-'}; "
                     f"resources {json.dumps(node.resources, sort_keys=True)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gyre.deploy.slurm_layout", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, required=True, help="nodes in the allocation (the head is node 0)")
    p.add_argument("--gpus-per-node", type=float, required=True, help="GPUs on each node")
    p.add_argument("--node", type=int, help="print this node's resources as JSON (for ray start --resources)")
    p.add_argument("recipe")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    from gyre.deploy.ray_entry import gyre_checkout
    from gyre.services.cli.main import _parse_sets
    from gyre.services.control.recipe.schema import RecipeError, load_recipe

    recipe_path = Path(args.recipe)
    if not recipe_path.is_absolute() and not recipe_path.exists() and gyre_checkout() is not None:
        recipe_path = gyre_checkout() / recipe_path  # as deploy/ray_entry.py resolves it for the run
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the recipe's warnings: stdout is the JSON the script reads
            recipe = load_recipe(recipe_path, _parse_sets(args.set), dry_run=True)
        layout = node_layouts(recipe.placement, recipe.replay.shards, recipe.rollout.num_workers, args.nodes,
                              args.gpus_per_node, reward_model=bool(recipe.model_rewards()))
        if args.node is not None and not 0 <= args.node < args.nodes:
            raise LayoutError(f"--node {args.node}: expected 0 to {args.nodes - 1}")
    except (RecipeError, LayoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(layout[args.node].resources, sort_keys=True) if args.node is not None else describe(layout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
