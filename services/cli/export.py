"""``gyre export CHECKPOINT OUT_DIR``: a verified learner checkpoint → a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path


def export_checkpoint(checkpoint: Path, out_dir: Path) -> Path:
    """Rebuild the learner engine from the checkpoint's ``learner_config.json``, load the checkpoint
    (manifest verified first) and write safetensors + config + tokenizer to ``out_dir``.

    Raises:
        learner.checkpoint.CheckpointError: missing, corrupt, or written without a learner config.
    """
    from gyre.learner.checkpoint import store as ckpt
    from gyre.learner.config import AlgorithmConfig, LearnerConfig
    from gyre.learner.engine import LearnerEngine

    checkpoint = Path(checkpoint)
    meta = ckpt.verify(checkpoint)
    config_file = checkpoint / ckpt.LEARNER_CONFIG
    if not config_file.is_file():
        raise ckpt.CheckpointError(f"checkpoint {checkpoint}: {ckpt.LEARNER_CONFIG} is missing; cannot export")
    config = LearnerConfig.model_validate_json(config_file.read_text())
    algo_file = checkpoint / ckpt.ALGORITHM_CONFIG
    algo = AlgorithmConfig.model_validate_json(algo_file.read_text()) if algo_file.is_file() else AlgorithmConfig()
    # The state must match (a critic's value_head is in it); a KL reference model is not needed to export.
    engine = LearnerEngine(config, algo.model_copy(update={"kl_coef": 0.0}))
    engine.load_checkpoint(checkpoint, fingerprint=meta.fingerprint)
    engine.export_hf(Path(out_dir), config.model)
    return Path(out_dir)
