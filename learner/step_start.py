"""What a learner step computes from the policy as it stands, before its update: the proximal logprobs
(the PPO anchor and the ``pi_proximal / pi_behaviour`` importance weights) and the critic's ``V_old``. They
are those of the deterministic network vLLM samples from, so they are computed with dropout off
(``eval_mode``).

Training forwards keep the model's own dropout (a config with ``attention_dropout > 0`` still regularises
the update and draws from the torch RNG); only these step-start passes switch it off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_DROPOUT_NAMES = ("dropout", "pdrop")
"""Substrings of config/module attribute names that hold a dropout probability (``attention_dropout``,
``hidden_dropout``, GPT-2's ``attn_pdrop``...)."""


def _dropout_values(obj) -> list[float]:
    values = []
    for name, value in vars(obj).items():
        if any(k in name for k in _DROPOUT_NAMES) and isinstance(value, (int, float)) and not isinstance(value, bool):
            values.append(float(value))
    return values


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether a forward of ``model`` in train mode can be random: a ``torch.nn`` dropout module with
    ``p > 0``, or a positive dropout probability in a module attribute or in the HF config (HF attention
    applies ``self.attention_dropout`` functionally, outside any dropout module).

    Args:
        model: any module; ``model.config`` (an HF ``PretrainedConfig``, sub-configs included) is read when
            present.

    Returns:
        True when any such probability is > 0 (conservative: a positive value the architecture ignores
        also counts).
    """
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        if any(v > 0 for v in _dropout_values(module)):
            return True
    config = getattr(model, "config", None)
    configs = [config] if config is not None else []
    while configs:
        cfg = configs.pop()
        if any(v > 0 for v in _dropout_values(cfg)):
            return True
        configs += [v for v in vars(cfg).values() if hasattr(v, "to_dict") and hasattr(v, "__dict__")]
    return False


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Switch ``module`` (and every submodule) to eval mode, so dropout is off, and restore the previous
    ``training`` flag of the module tree on exit (each submodule's own flag, even on an exception)."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in flags:
            m.training = training

