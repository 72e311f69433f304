"""``deploy/slurm_layout.py``: the custom Ray resources each node of a Slurm allocation advertises, from the recipe."""

import json

import pytest

from gyre.deploy.slurm_layout import UNBOUNDED, LayoutError, main, node_layouts
from gyre.services.control.orchestration.placement import PlacementConfig

CLUSTER = "deploy/recipes/qwen2.5-1.5b-gsm8k-cluster.yaml"


def placement(**roles) -> PlacementConfig:
    return PlacementConfig(**roles)


PINNED = placement(replay={"resources": {"gyre_replay": 1}},
                   learner={"num_gpus": 1, "world_size": 4, "strategy": "STRICT_PACK", "resources": {"gyre_learner": 1}},
                   rollout={"num_gpus": 1, "resources": {"gyre_rollout": 1}})


def test_the_head_holds_replay_and_the_learner_and_rollouts_take_every_gpu_left():
    head, other = node_layouts(PINNED, replay_shards=2, rollouts=10, nodes=2, gpus_per_node=8)
    assert head.resources == {"gyre_replay": 2.0, "gyre_learner": 4.0, "gyre_rollout": 4.0}
    assert head.roles == {"replay": 2, "learner": 4, "rollout": 4}
    assert other.resources == {"gyre_rollout": 8.0} and other.roles == {"rollout": 8}


def test_a_recipe_without_custom_resources_advertises_none():
    layout = node_layouts(placement(), replay_shards=1, rollouts=3, nodes=3, gpus_per_node=0)
    assert [n.resources for n in layout] == [{}, {}, {}]
    assert layout[1].roles == {"rollout": UNBOUNDED}  # no GPU per rollout: no limit but Ray's CPUs


def test_hosted_rollouts_need_a_gpu_per_process_not_per_rollout():
    p = placement(rollout={"num_gpus": 1, "rollouts_per_process": 4, "resources": {"r": 1}})
    (head,) = node_layouts(p, replay_shards=1, rollouts=8, nodes=1, gpus_per_node=2)
    assert head.resources == {"r": 2.0}
    with pytest.raises(LayoutError, match=r"rollout.num_workers 9 needs 3 rollout process\(es\).*hold 2"):
        node_layouts(p, replay_shards=1, rollouts=9, nodes=1, gpus_per_node=2)


def test_a_learner_larger_than_a_node_is_refused_with_the_numbers():
    with pytest.raises(LayoutError, match=r"world_size 4 x num_gpus 1 = 4 GPUs, but a node has 2"):
        node_layouts(PINNED, replay_shards=1, rollouts=1, nodes=4, gpus_per_node=2)


def test_too_few_nodes_for_the_fleet_names_how_many_to_ask_for():
    with pytest.raises(LayoutError, match=r"needs 20 rollout process\(es\).*hold 12.*sbatch --nodes=3"):
        node_layouts(PINNED, replay_shards=1, rollouts=20, nodes=2, gpus_per_node=8)


def test_a_reward_model_takes_its_gpu_on_the_head_only_when_the_recipe_has_one():
    p = placement(learner={"num_gpus": 1}, rollout={"num_gpus": 1}, reward_model={"num_gpus": 1, "resources": {"rm": 1}})
    head, = node_layouts(p, replay_shards=1, rollouts=2, nodes=1, gpus_per_node=4, reward_model=True)
    assert head.roles == {"replay": 1, "learner": 1, "reward_model": 1, "rollout": 2} and head.resources == {"rm": 1.0}
    head, = node_layouts(p, replay_shards=1, rollouts=2, nodes=1, gpus_per_node=4)
    assert "reward_model" not in head.roles and head.roles["rollout"] == 3
    with pytest.raises(LayoutError, match="reward_model: num_gpus 1, but the learner leaves 0"):
        node_layouts(p, replay_shards=1, rollouts=0, nodes=1, gpus_per_node=1, reward_model=True)


def test_bad_allocations_are_refused():
    with pytest.raises(LayoutError, match="0 node"):
        node_layouts(placement(), replay_shards=1, rollouts=1, nodes=0, gpus_per_node=8)


def test_the_cli_prints_the_plan_and_one_nodes_json(capsys):
    assert main(["--nodes", "2", "--gpus-per-node", "8", CLUSTER]) == 0
    plan = capsys.readouterr().out
    assert "node 0 (head): 8 GPU(s); replay x1, learner x4, rollout x4;" in plan and "node 1: 8 GPU(s); rollout x8" in plan
    assert main(["--nodes", "2", "--gpus-per-node", "8", "--node", "1", CLUSTER]) == 0
    assert json.loads(capsys.readouterr().out) == {"gyre_rollout": 8.0}  # stdout is the JSON alone


def test_the_cli_refuses_a_recipe_that_does_not_fit(capsys):
    assert main(["--nodes", "1", "--gpus-per-node", "4", CLUSTER]) == 2
    assert "error: rollout.num_workers 4 needs 4 rollout process(es)" in capsys.readouterr().err
    assert main(["--nodes", "2", "--gpus-per-node", "8", "--node", "2", CLUSTER]) == 2
    assert "--node 2: expected 0 to 1" in capsys.readouterr().err
    assert main(["--nodes", "2", "--gpus-per-node", "8", CLUSTER, "--set", "placement.learner.world_size=0"]) == 2
    assert "world_size" in capsys.readouterr().err
