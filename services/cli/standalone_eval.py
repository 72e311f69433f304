"""``gyre eval MODEL_OR_CHECKPOINT RECIPE``: the recipe's held-out evaluation (``eval:``) of one policy, with no
run: one vLLM engine in this process, driven by a ``RolloutWorker`` exactly as in a run (same prompts, seeds,
scoring and metrics), no replay, learner or Ray.

The policy is a Hugging Face model folder (its version: ``gyre_version.json``'s ``policy_version`` if present,
else 0) or a learner checkpoint ``global_step_N`` (verified, then exported to a temporary HF folder by
``gyre export`` in a child process, which keeps DeepSpeed out of this one; its version: the checkpoint's
``policy_version``). Writes ``{out}/eval/step_{version}.jsonl`` and appends one row to ``{out}/metrics.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from gyre.rollout.evaluation import EvalResult

DEFAULT_OUT = "standalone-eval"
"""Output folder under the recipe's run directory (``{run_dir}/{name}/standalone-eval``) unless ``--out``."""


class EvalTargetError(ValueError):
    """The MODEL_OR_CHECKPOINT argument is neither an HF model folder nor a learner checkpoint."""


def target_kind(path: Path) -> str:
    """``"model"`` (``config.json`` + ``*.safetensors``) or ``"checkpoint"`` (a ``manifest.json`` of a learner
    checkpoint). Raises ``EvalTargetError`` naming the path and what was expected."""
    from gyre.learner.checkpoint.store import MANIFEST

    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "model"
    if (path / MANIFEST).is_file():
        return "checkpoint"
    raise EvalTargetError(f"{path} is neither a Hugging Face model folder (config.json + *.safetensors) nor a "
                          f"learner checkpoint (checkpoints/global_step_N with {MANIFEST})")


def model_version(folder: Path) -> int:
    """The policy version of an HF folder: ``gyre_version.json``'s ``policy_version`` (an export of a run), else 0."""
    from gyre.proto.exports import VERSION_FILE

    file = folder / VERSION_FILE
    return int(json.loads(file.read_text())["policy_version"]) if file.is_file() else 0


def export_to(checkpoint: Path, out_dir: Path) -> int:
    """Verify ``checkpoint`` and export it to ``out_dir`` with ``gyre export`` in a child process; returns its
    policy version. Raises ``learner.checkpoint.store.CheckpointError`` (corrupt, or the export failed, with its
    output)."""
    from gyre.learner.checkpoint.store import CheckpointError, verify

    meta = verify(checkpoint)
    proc = subprocess.run([sys.executable, "-m", "gyre.services.cli", "export", str(checkpoint), str(out_dir)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise CheckpointError(f"exporting {checkpoint} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                              f"{proc.stderr[-2000:]}")
    return meta.policy_version


async def evaluate_folder(recipe, version: int, start_engine=None) -> EvalResult:
    """Start an engine on ``recipe.rollout.engine`` (its ``model`` is the policy) at ``version`` and run
    ``RolloutWorker.evaluate(recipe.eval)``; the engine is shut down afterwards. ``start_engine(config,
    version)`` defaults to ``RolloutEngine.start`` (vLLM)."""
    from transformers import AutoTokenizer

    from gyre.rollout.tasks import TaskSource
    from gyre.rollout.worker import RolloutWorker

    if start_engine is None:
        from gyre.rollout.engine import RolloutEngine

        start_engine = RolloutEngine.start
    config = recipe.rollout.model_copy(update={"spool_dir": None, "lockstep": None})
    if recipe.model_rewards():  # no reward-model service here: the recipe's reward models score in this process
        from gyre.rollout.rewards.model import set_transport
        from gyre.services.reward_model.host import LocalRewardModels

        set_transport(LocalRewardModels())
    engine = await start_engine(config.engine, version)
    try:
        tokenizer = AutoTokenizer.from_pretrained(config.engine.model)
        worker = RolloutWorker("eval", config, TaskSource(recipe.task), engine, None, tokenizer, recipe.seed)
        return await worker.evaluate(recipe.eval)
    finally:
        await engine.shutdown()


def run_standalone(target: str, load, out: str | None, console, start_engine=None) -> dict:
    """Evaluate ``target`` (see the module docstring) under the recipe ``load(model_folder)`` returns (the
    recipe with ``model`` set to that folder); print a table and the output paths; return the metrics row.

    Raises:
        EvalTargetError: ``target`` is not a model folder or checkpoint.
        learner.checkpoint.CheckpointError: a corrupt checkpoint, or its export failed.
        services.control.recipe.RecipeError: from ``load``.
    """
    from gyre.services.control.orchestration.evaluation import eval_table, record_eval
    from gyre.services.control.outputs.report import MetricsWriter

    path = Path(target).expanduser().resolve()
    if not path.is_dir():
        raise EvalTargetError(f"{target} does not exist or is not a directory")
    with tempfile.TemporaryDirectory(prefix="gyre-eval-") as tmp:
        if target_kind(path) == "checkpoint":
            with console.status(f"exporting {path} to a Hugging Face folder…"):
                version = export_to(path, Path(tmp) / "model")
            folder = Path(tmp) / "model"
        else:
            folder, version = path, model_version(path)
        recipe = load(str(folder))
        with console.status(f"evaluating {target} (policy version {version})…"):
            result = asyncio.run(evaluate_folder(recipe, version, start_engine))
    out_dir = Path(out) if out else recipe.out_dir / DEFAULT_OUT
    metrics = MetricsWriter(out_dir / "metrics.jsonl")
    try:
        row = record_eval(result, out_dir, metrics, "standalone", target=str(path))
    finally:
        metrics.close()
    console.print(eval_table(result.metrics, f"{target} (policy version {version}) on {recipe.name}'s held-out sets"))
    console.print(f"completions in {out_dir / 'eval' / f'step_{version}.jsonl'}; metrics row in "
                  f"{out_dir / 'metrics.jsonl'}", highlight=False, soft_wrap=True)
    return row
