"""Which runner plays a rollout's groups as episodes, from its config (multi-turn environment or verifiers)."""

from __future__ import annotations

from gyre.rollout.agents.agent_group import EpisodeRunner
from gyre.rollout.config import RolloutConfig


def episode_runner(config: RolloutConfig, tokenizer):
    """What plays a group's episodes: ``EpisodeRunner`` (``rollout.environment``), ``VerifiersRunner``
    (``rollout.verifiers``; imported only then) or ``None`` (single completions)."""
    if config.environment is not None:
        return EpisodeRunner(config.environment, tokenizer)
    if config.verifiers is not None:
        from gyre.rollout.agents.verifiers_env import VerifiersRunner

        return VerifiersRunner(config.verifiers, config.engine.model, tokenizer)
    return None
