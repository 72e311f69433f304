"""``gyre run --dry-run`` prints the learner's memory per rank and which ZeRO stages fit
(``services.control.recipe.memory_plan``): from a model's config.json (never its weights, nothing downloaded),
the recipe's micro-batch tokens, its GPU type or 80 GiB, and vLLM's share when rollouts share the learner's GPUs."""

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from gyre.learner.memory_estimate import GIB
from gyre.services.cli import main as cli
from gyre.services.control.recipe.memory_plan import memory_lines, micro_batch_tokens
from gyre.services.control.recipe.schema import load_recipe
from tests.hf_cache import populate_hf_cache, use_hf_cache

REPO = Path(__file__).resolve().parents[3]
GPU_RECIPE = REPO / "deploy/recipes/qwen2.5-1.5b-gsm8k-1node.yaml"
QWEN25_15B = {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
              "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True}
LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256, "tie_word_embeddings": False}


def _model(tmp_path: Path, config: dict, name: str = "model") -> Path:
    """A model folder holding only ``config.json`` (no weights: the estimate never reads them)."""
    folder = tmp_path / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _lines(tmp_path, config: dict | None, **overrides) -> list[str]:
    model = {"model": str(_model(tmp_path, config))} if config is not None else {}
    recipe = load_recipe(GPU_RECIPE, {**model, "run_dir": str(tmp_path / "runs"), **overrides}, dry_run=True)
    return memory_lines(recipe)


def _fits(lines: list[str]) -> dict[int, bool]:
    """ZeRO stage -> fits, from the stage line ``ZeRO-0 34.8 fits · ZeRO-1 ... does not fit · ...``."""
    row = next(line for line in lines if line.strip().startswith("ZeRO-0 "))
    return {int(part.split()[0][5:]): not part.endswith("does not fit") for part in row.strip().split(" · ")}


def test_zero3_on_a_1_5b_model_over_8_ranks_of_80_gb_recommends_zero2(tmp_path):
    lines = _lines(tmp_path, QWEN25_15B, **{"learner.engine.zero_stage": 3, "placement.learner.world_size": 8})
    text = "\n".join(lines)
    assert "1.54 B parameters, 28 layers × hidden 1536, vocab 151936" in lines[0]
    assert str(tmp_path / "model" / "config.json") in lines[0]
    assert "ZeRO-3 bf16 over 8 ranks" in text and "16384 tokens per micro-batch" in text
    assert "GPU 80 GiB assumed (the recipe names no GPU type" in text and "a rank fits in 72 GiB" in text
    assert _fits(lines) == {0: True, 1: True, 2: True, 3: True}
    assert lines[-1].strip().startswith("recommend ZeRO-2 (learner.engine.zero_stage: 2): it fits")
    assert "re-gathers every layer's parameters in each forward and again in backward" in lines[-1]


def test_the_shipped_stage_fits_and_draws_no_advice(tmp_path):
    lines = _lines(tmp_path, QWEN25_15B)
    assert "ZeRO-2 bf16 over 4 ranks" in lines[1] and lines[1].endswith("= 14.7 GiB")
    assert _fits(lines)[2] and not any("recommend" in line or "does not fit (" in line for line in lines)


def test_a_70b_model_fits_only_zero3_and_over_8_ranks_only_offloaded(tmp_path):
    wide = _lines(tmp_path / "a", LLAMA_70B, **{"placement.learner.world_size": 32,
                                                 "learner.engine.micro_batch_tokens": 4096})
    assert "70.6 B parameters" in wide[0]
    assert _fits(wide) == {0: False, 1: False, 2: False, 3: True}
    assert "ZeRO-2 does not fit (" in wide[-1] and wide[-1].strip().endswith(")") and "use ZeRO-3" in wide[-1]
    node = _lines(tmp_path / "b", LLAMA_70B, **{"placement.learner.world_size": 8, "learner.engine.zero_stage": 3,
                                                 "learner.engine.micro_batch_tokens": 4096})
    assert _fits(node) == {0: False, 1: False, 2: False, 3: False}
    assert "no stage fits in 72 GiB: ZeRO-3 with offload_optimizer: cpu does" in node[-1]
    offloaded = _lines(tmp_path / "c", LLAMA_70B, **{"placement.learner.world_size": 8, "learner.engine.zero_stage": 3,
                                                      "learner.engine.micro_batch_tokens": 4096,
                                                      "learner.engine.offload_optimizer": "cpu"})
    assert _fits(offloaded)[3] and "GiB in host memory" in offloaded[1] and "recommend" not in offloaded[-1]


def test_offloading_where_the_gpu_holds_it_all_draws_a_recommendation(tmp_path):
    lines = _lines(tmp_path, QWEN25_15B, **{"learner.engine.offload_optimizer": "cpu"})
    assert "optimizer 0 +" in lines[1] and "GiB in host memory" in lines[1]
    assert lines[-1].strip().startswith("recommend offload_optimizer: none: ZeRO-2 fits without it")


def test_the_recipes_gpu_type_sets_the_memory(tmp_path):
    lines = _lines(tmp_path, QWEN25_15B, **{"placement.learner.resources": {"accelerator_type:L40S": 0.001}})
    assert "GPU L40S, 48 GiB (placement.learner.resources)" in lines[3] and f"fits in {0.9 * 48:.3g} GiB" in lines[3]
    odd = _lines(tmp_path / "x", QWEN25_15B, **{"placement.learner.resources": {"accelerator_type:Z9": 1}})
    assert "80 GiB assumed (accelerator_type 'Z9' is not one gyre knows" in odd[3]


def test_rollouts_sharing_the_learners_gpu_take_their_vllm_share(tmp_path):
    lines = _lines(tmp_path, QWEN25_15B, **{"placement.learner.num_gpus": 0.5, "placement.rollout.num_gpus": 0.5})
    assert "vLLM 68 GiB: 1 rollout(s) beside each learner rank" in lines[3]
    assert "gpu_memory_utilization 0.85" in lines[3]
    assert f"fits in {0.9 * (80 - 68):.3g} GiB" in lines[3]
    shared = {"placement.learner.num_gpus": 0.5, "placement.rollout.num_gpus": 0.25, "rollout.engine.kv_cache_gib": 4}
    pinned = _lines(tmp_path / "kv", QWEN25_15B, **shared)
    vllm = 2 * (2 * 1_543_714_304 + 4 * GIB)  # two rollouts beside the learner: bf16 weights + 4 GiB cache each
    assert f"vLLM {vllm / GIB:.3g} GiB: 2 rollout(s)" in pinned[3] and "weights + kv_cache_gib 4" in pinned[3]
    apart = _lines(tmp_path / "apart", QWEN25_15B)
    assert "vLLM 0 GiB: rollouts on GPUs of their own, placement num_gpus: learner 1, rollout 1" in apart[3]


def test_tokens_per_micro_batch_from_rows_when_no_token_budget(tmp_path):
    recipe = load_recipe(GPU_RECIPE, {"model": str(_model(tmp_path, QWEN25_15B)), "run_dir": str(tmp_path),
                                      "learner.engine": {"micro_batch_size": 4, "zero_stage": 2}}, dry_run=True)
    tokens, how = micro_batch_tokens(recipe)
    assert tokens == 4 * 1536 and "micro_batch_size 4 × the longest row, rollout.engine.max_model_len 1536" in how


def test_a_hub_id_is_read_from_the_hf_cache_or_gyres_copy_and_never_downloaded(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    use_hf_cache(monkeypatch, cache)
    shipped = _lines(tmp_path / "a", None)  # Qwen/Qwen2.5-1.5B-Instruct, not cached
    assert "1.54 B parameters" in shipped[0]
    assert "gyre's copy of its config.json numbers: not in the HF cache" in shipped[0]
    commit = populate_hf_cache(cache, "org/small", _model(tmp_path, {**QWEN25_15B, "num_hidden_layers": 2}, "src"))
    cached = _lines(tmp_path / "b", None, model="org/small")
    assert "2 layers" in cached[0] and f"models--org--small/snapshots/{commit}/config.json" in cached[0]
    unknown = _lines(tmp_path / "c", None, model="org/unknown")
    assert unknown == ["memory     not estimated: no config.json of the model at hand (org/unknown is not in the HF "
                       "cache and a dry run downloads nothing (`hf download org/unknown config.json` puts its config "
                       "there))"]


def test_a_bad_config_is_one_line_not_a_failed_dry_run(tmp_path):
    lines = _lines(tmp_path, {"model_type": "llama", "hidden_size": 64})
    assert len(lines) == 1 and lines[0].startswith("memory     not estimated: config.json of model_type 'llama' lacks")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    recipe = load_recipe(GPU_RECIPE, {"model": str(tmp_path / "bad"), "run_dir": str(tmp_path)}, dry_run=True)
    bad = memory_lines(recipe)
    assert len(bad) == 1 and bad[0].startswith(f"memory     not estimated: {tmp_path / 'bad' / 'config.json'}")
    assert "is not JSON: Expecting property name" in bad[0]


def test_a_cpu_learner_gets_its_host_memory_and_no_stage_advice(tiny_llama, tmp_path):
    recipe = load_recipe(REPO / "deploy/recipes/tiny-test.yaml", {"model": str(tiny_llama), "run_dir": str(tmp_path)},
                         dry_run=True)
    lines = memory_lines(recipe)
    assert lines[-1].strip() == "the learner runs on CPU (placement.learner.num_gpus 0): host memory, no GPU to fit"
    assert not any("fits" in line for line in lines)


@pytest.mark.parametrize("stage", [3, 2])
def test_dry_run_prints_the_memory_block(stage, tmp_path, monkeypatch):
    console = Console(file=io.StringIO(), width=400)
    monkeypatch.setattr(cli, "Console", lambda: console)
    model = _model(tmp_path, QWEN25_15B)
    args = ["run", str(GPU_RECIPE), "--dry-run", "--set", f"model={model}", "--set", f"run_dir={tmp_path}",
            "--set", f"learner.engine.zero_stage={stage}", "--set", "placement.learner.world_size=8"]
    assert cli.main(args) == 0, console.file.getvalue()
    out = console.file.getvalue().splitlines()
    block = out[next(i for i, line in enumerate(out) if line.startswith("memory     ")):
                next(i for i, line in enumerate(out) if line.startswith("placement  "))]
    assert block[0].startswith("memory     learner per rank (learner.memory_estimate): 1.54 B parameters")
    assert f"ZeRO-{stage} bf16 over 8 ranks" in block[1]
    assert "ZeRO-1" in block[4] and "ZeRO-2" in block[4] and "does not fit" not in block[4]
    assert any(line.strip().startswith("recommend ZeRO-2") for line in block) == (stage == 3)
    assert f"DeepSpeed ZeRO-{stage} bf16 lr=1e-06 micro_batch_tokens=16384 grad-checkpointing" in "\n".join(out)
