"""The checked-in cluster files validate against the installed Ray's cluster schema and say what gyre needs."""

import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from tests.deploy.system import REPO


def _load(name: str) -> dict:
    config = prepare_config(yaml.safe_load((REPO / "deploy" / name).read_text()))
    validate_config(config)  # raises jsonschema.ValidationError naming the bad field
    return config


def test_cloud_cluster_has_separate_rollout_and_learner_gpu_types():
    config = _load("cluster.yaml")
    assert config["provider"]["type"] == "aws"
    types = config["available_node_types"]
    assert config["head_node_type"] == "head"
    assert types["head"]["resources"] == {"gyre_replay": 1}
    assert types["rollout_gpu"]["resources"] == {"gyre_rollout": 1}
    assert types["learner_gpu"]["resources"] == {"gyre_learner": 4}  # one per GPU: a rank per unit
    for name in ("rollout_gpu", "learner_gpu"):  # GPU instance families only
        assert types[name]["node_config"]["InstanceType"].split(".")[0] in {"g5", "g6", "g6e", "p4d", "p5"}
    setup = " ".join(config["setup_commands"])
    # the cuda lock, whole and without resolving (no second vLLM, no CPU torch), then gyre without deps
    assert "pip install -q --no-deps -r requirements/cuda.lock" in setup and "deploy.prepare_model" in setup
    assert "pip install -q --no-deps -e ." in setup and "[cuda]" not in setup and "cpu.lock" not in setup
    assert "HF_HUB_OFFLINE" not in setup  # offline mode is the user's choice
    assert config["file_mounts"] == {"~/gyre": "."}
    assert {".venv", ".cache", "runs"} <= set(config["rsync_exclude"])


def test_local_cluster_stays_off_default_ports_and_never_stops_other_rays():
    config = _load("local-cluster.yaml")
    assert config["provider"] == {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
    start = " ".join(config["head_start_ray_commands"])
    for flag in ("--port=6390", "--dashboard-port=8275", "--ray-client-server-port=10011",
                 "--dashboard-agent-listen-port=52375", "--min-worker-port=21000", "--max-worker-port=21099",
                 "--temp-dir=/tmp/gyre-ray"):
        assert flag in start, flag
    # A bare `ray stop` would kill every Ray instance of the user on a shared head.
    assert not any("ray stop" in c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"])
    assert "RAY_ADDRESS=127.0.0.1:6390" in " ".join(config["setup_commands"])


def test_placement_example_in_cluster_yaml_is_a_valid_recipe_section(tiny_llama):
    from gyre.services.control.recipe.schema import load_recipe

    lines = (REPO / "deploy" / "cluster.yaml").read_text().splitlines()
    start = lines.index("#   placement:")
    block = [line[1:] for line in lines[start:] if line.startswith("#   ")]
    block = block[:next(i for i, line in enumerate(block[1:], 1) if not line.startswith("     "))]
    placement = yaml.safe_load("\n".join(block))["placement"]
    recipe = load_recipe(REPO / "deploy" / "recipes" / "tiny-cluster.yaml",
                         {"model": str(tiny_llama), "placement": placement})
    assert recipe.placement.rollout.resources == {"gyre_rollout": 1}
    assert recipe.placement.learner.bundles() == [{"GPU": 1, "gyre_learner": 1}] * 4
