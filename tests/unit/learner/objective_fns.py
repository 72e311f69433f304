"""Custom objectives the objective tests name by import path (``tests.unit.learner.objective_fns:NAME``): ones that
match a built-in exactly, and ones that break the contract (``learner.objectives``) in one named way each."""

from __future__ import annotations

import torch

from gyre.learner.algo.advantages import group_advantages
from gyre.learner.algo.losses import policy_loss

SEEN: list = []
"""The inputs ``recording_grpo`` was called with, in order."""


def grpo(inputs):
    """The built-in ``grpo`` estimator through the custom path (every row scored)."""
    return group_advantages("grpo", inputs.rewards, inputs.group_rows, inputs.cfg.adv_eps)


def recording_grpo(inputs):
    SEEN.append(inputs)
    return grpo(inputs)


def per_token_ones(inputs):
    """``[B, T]`` ones everywhere (gyre zeroes them off the mask and outside ``scored``)."""
    return torch.ones(inputs.response_mask.shape, dtype=torch.float32)


def wrong_shape(inputs):
    return torch.zeros(inputs.rewards.shape[0], 3)


def float64(inputs):
    return inputs.rewards.double()


def nan_advantage(inputs):
    return inputs.rewards * float("nan")


def a_list(inputs):
    return inputs.rewards.tolist()


def raises(inputs):
    raise RuntimeError("boom")


def two_arguments(inputs, extra):
    return inputs


not_callable = 3


def ppo_clip(inputs):
    """The built-in ``ppo_clip`` loss through the custom path, with its metrics."""
    return policy_loss(inputs.logprobs, inputs.proximal_logprobs, inputs.behaviour_logprobs, inputs.advantages,
                       inputs.response_mask, inputs.cfg, inputs.normaliser, inputs.row_scale)


def loss_only(inputs):
    """REINFORCE's per-token loss ``-A log pi``, aggregated as gyre does; no metrics."""
    adv = inputs.advantages if inputs.advantages.dim() == 2 else inputs.advantages.unsqueeze(1)
    return inputs.aggregate(-adv * inputs.logprobs)


def per_row_loss(inputs):
    return -(inputs.logprobs * inputs.response_mask).sum(dim=1)


def detached_loss(inputs):
    return inputs.aggregate(inputs.logprobs.detach())


def nan_loss(inputs):
    return inputs.aggregate(inputs.logprobs) * float("nan")


def leaks_off_mask(inputs):
    return -inputs.logprobs.sum() / inputs.normaliser


def bad_metric(inputs):
    return loss_only(inputs), {"clip": "high"}


def infinite_gradient(inputs):
    return inputs.aggregate(torch.sqrt(inputs.logprobs - inputs.logprobs.detach()))  # sqrt(0): finite, d/dx = inf
