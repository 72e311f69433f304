"""Custom objectives: your own advantage estimator and policy loss, named by an import path in the recipe.

``learner.algorithm.advantage`` and ``learner.algorithm.loss`` take, beside the built-in names, ``"pkg.module:fn"``
or ``"path/to/file.py:fn"`` (loaded by ``utils.callable_spec``, as reward functions are; a relative file path is
made absolute against the working directory when the config loads). The recipe carries the path, never a
function: every learner rank imports it itself, so on a multi-node cluster it must exist at the same path on
every learner node (``ray.runtime_env`` reaches the rollout actors only; on one machine Ray puts the driver's
working directory on the learner's ``sys.path``). When the recipe loads, each custom function is imported and
run on a tiny synthetic batch (``learner.algo.objective_check``); a wrong shape, dtype, a non-finite value or a loss
without a gradient is refused there, naming the tensor and what was expected. Every call in training has its
output checked the same way (shape, dtype, finite, a loss that requires grad).

The tensor contract is the two frozen dataclasses below, one field per input (shape, dtype, meaning); it
is what the built-ins receive. ``B`` rows (trajectories) of ``G`` groups of ``n`` samples of one prompt;
``T = L - 1`` token positions, aligned with ``learner.algo.logprobs.token_logprobs``: position ``j`` scores token
``j + 1`` of the row's prompt + response, so ``response_mask`` is False on the prompt and the padding.

- **Advantage**: ``fn(inputs: AdvantageInputs) -> torch.Tensor``, ``[B]`` (one advantage per trajectory,
  broadcast over its tokens, as the outcome estimators) or ``[B, T]`` (per token, as GAE), float32, finite
  everywhere. It replaces the built-in estimator both where the batch is built and, with ``kl_placement:
  reward``, after the step-start pass (``rewards`` then hold the KL-shaped returns). gyre then sets it to 0 on
  rows outside ``scored`` and (``[B, T]``) off ``response_mask``. There is no critic: a custom estimator gets no
  values (``gae`` is the built-in with a value head).
- **Loss**: ``fn(inputs: LossInputs) -> torch.Tensor`` or ``(torch.Tensor, dict[str, float])``: a 0-dim float32
  loss with a gradient path to ``inputs.logprobs`` (0 off ``response_mask``), and optional metrics. It is called
  once per micro-batch in place of ``learner.algo.losses.policy_loss``; gyre adds the KL, entropy and value terms
  itself. **Aggregation**: the micro-batch losses of one optimizer update are *summed*, so the loss must be a
  sum over this micro-batch's tokens divided by ``inputs.normaliser`` (the whole mini-batch's ``loss_agg_mode``
  divisor), each row's tokens times ``inputs.row_scale``: ``inputs.aggregate(per_token)`` does exactly this, as
  the built-in does. A mean over the micro-batch would weigh micro-batches, not tokens. Metrics are logged as
  ``custom_loss/<name>`` (token-weighted over micro-batches), beside the importance-ratio diagnostics
  ``is_ratio_mean``, ``is_ratio_max`` and ``approx_kl``, which do not depend on the loss.

Examples to copy: ``examples/objectives/`` (a REINFORCE-with-baseline advantage, a clipped IS-weighted
policy-gradient loss).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gyre.learner.algo.losses import ratio_metrics, scaled_token_sum
from gyre.utils.callable_spec import CallableSpecError, load_callable, split_spec


@dataclass(frozen=True)
class AdvantageInputs:
    """What a custom advantage estimator receives (``learner.algorithm.advantage: "pkg.module:fn"``); CPU tensors."""

    rewards: torch.Tensor
    """``[B]`` float32: each row's return, what the built-in estimators take: the verifier's reward plus DAPO's
    overlong penalty (``TrainBatch.shaped_rewards``), and with ``kl_placement: reward`` minus ``kl_coef * sum_t
    x_t`` over its response tokens (``x = log pi - log pi_ref`` at step start; a row ``overlong_filter`` masked
    keeps its reward)."""

    group_rows: torch.Tensor
    """``[G, n]`` int64: the row indices of each group (the ``n`` samples of one prompt), every row exactly once;
    ``rewards[group_rows]`` is the ``[G, n]`` layout of ``learner.algo.advantages.outcome_advantages``."""

    scored: torch.Tensor
    """``[B]`` bool: the rows whose reward counts (``failed_scores``: a row whose score failed, or with
    ``drop_groups`` its whole group, is False). A row outside trains no token; leave its reward out of the
    baselines."""

    response_mask: torch.Tensor
    """``[B, T]`` bool: the response tokens that train (``TrainBatch.response_mask``: all False for a row outside
    ``scored`` and, with ``overlong_filter``, for a truncated row). ``response_mask.sum(1)`` are the token counts
    ``reinforce_pp`` whitens with."""

    behaviour_logprobs: torch.Tensor
    """``[B, T]`` float32: the rollout's (vLLM's) logprob of each sampled token, 0 off ``response_mask``."""

    staleness: torch.Tensor
    """``[B]`` int64: each row's policy lag, ``learner version - oldest policy version of its tokens``."""

    cfg: Any
    """The run's ``learner.config.AlgorithmConfig`` (``adv_eps``, ``gamma``, ...)."""


@dataclass(frozen=True)
class LossInputs:
    """What a custom policy loss receives (``learner.algorithm.loss: "pkg.module:fn"``), for one micro-batch of
    ``B`` rows; tensors on the learner's device. The same arguments ``learner.algo.losses.policy_loss`` takes."""

    logprobs: torch.Tensor
    """``[B, T]`` float32: ``log pi_theta`` of each sampled token under the policy being trained (temperature
    applied), **with grad**: the loss's gradient flows through it alone."""

    proximal_logprobs: torch.Tensor
    """``[B, T]`` float32, detached: the learner's logprobs before this batch's first update (the decoupled-PPO
    anchor ``pi_prox``). With one update per batch (``ppo_epochs * mini_batches == 1``) it is ``logprobs.detach()``."""

    behaviour_logprobs: torch.Tensor
    """``[B, T]`` float32, detached: the rollout's logprobs ``log pi_behaviour``, 0 off ``response_mask``.
    ``exp(proximal - behaviour)`` is the importance ratio ``rho`` that TIS/MIS correct."""

    advantages: torch.Tensor
    """``[B]`` (one per row) or ``[B, T]`` (per token: ``gae``, or a custom estimator that returns them) float32,
    detached, 0 off ``response_mask``."""

    response_mask: torch.Tensor
    """``[B, T]`` bool: the tokens that count; the loss must not depend on ``logprobs`` elsewhere."""

    cfg: Any
    """The run's ``learner.config.AlgorithmConfig`` (``clip_eps_low``, ``tis_cap``, ``agg_mode``, ...)."""

    normaliser: float
    """``> 0``: what the token sum is divided by, of the whole mini-batch (``learner.algo.losses.loss_normaliser``
    for ``loss_agg_mode``): its valid tokens (``token-mean``), rows, or rows ``* max_response_tokens``."""

    row_scale: torch.Tensor | None
    """``[B]`` float32 per-row factor on every token's loss (``1 / |o_i|`` for ``seq-mean-token-mean``,
    ``learner.algo.losses.row_token_scale``), or None for 1."""

    def aggregate(self, per_token: torch.Tensor) -> torch.Tensor:
        """``sum_{i,t in response_mask} per_token[i, t] * row_scale[i] / normaliser``: the micro-batch's share of
        the mini-batch's ``loss_agg_mode`` aggregate, as the built-in loss forms it. ``per_token``: ``[B, T]``
        float; returns a 0-dim tensor, differentiable in ``per_token``."""
        return scaled_token_sum(per_token, self.response_mask, self.row_scale) / self.normaliser


class ObjectiveError(ValueError):
    """A custom objective that cannot be used; the message names the recipe key, the path and the problem."""


EXPECTED = {
    "advantage": "fn(inputs: learner.objectives.AdvantageInputs) -> [B] or [B, T] float32 tensor",
    "loss": "fn(inputs: learner.objectives.LossInputs) -> 0-dim loss tensor, or (loss, dict of float metrics)",
}
"""What each key's function must be, for the error messages."""

_LOADED: dict[str, Callable] = {}
"""Import path → the function, imported once per process (a run uses one version of it)."""


def contract_error(key: str, spec: str, what: str) -> ObjectiveError:
    """The error for ``learner.algorithm.<key>: <spec>`` doing ``what``, with the contract it breaks."""
    return ObjectiveError(f"learner.algorithm.{key} {spec!r}: {what} (the contract: {EXPECTED[key]})")


def load_objective(key: str, spec: str) -> Callable:
    """Import the function ``spec`` names for ``key`` (``"advantage"`` or ``"loss"``), once per process.

    Raises:
        ObjectiveError: a bad path, a module or file that does not import, a missing attribute, something
            not callable, or a signature that cannot take one positional argument.
    """
    if spec in _LOADED:
        return _LOADED[spec]
    try:
        split_spec(spec)
        fn, _ = load_callable(spec)
    except CallableSpecError as exc:
        raise contract_error(key, spec, str(exc)) from None
    try:
        inspect.signature(fn).bind(object())
    except TypeError as exc:
        raise contract_error(key, spec, f"{spec.rpartition(':')[2]}{inspect.signature(fn)} cannot be called with one "
                               f"argument: {exc}") from None
    except ValueError:  # no signature to inspect (some builtins): the call will tell
        pass
    _LOADED[spec] = fn
    return fn


def _check_tensor(key: str, spec: str, name: str, t: Any, shapes: dict[str, tuple[int, ...]]) -> torch.Tensor:
    """``t`` is a float32 tensor of one of ``shapes`` (label → shape) with only finite values, else an
    ``ObjectiveError`` naming ``name``, what it is and what was expected."""
    want = " or ".join(f"{label} = {list(shape)}" if label != "[]" else "[] (0-dim)" for label, shape in shapes.items())
    if not isinstance(t, torch.Tensor):
        raise contract_error(key, spec, f"{name} is a {type(t).__name__}; expected a torch.Tensor of shape {want}")
    if tuple(t.shape) not in shapes.values():
        raise contract_error(key, spec, f"{name} has shape {list(t.shape)}; expected {want}")
    if t.dtype != torch.float32:
        raise contract_error(key, spec, f"{name} has dtype {t.dtype}; expected torch.float32")
    bad = int((~torch.isfinite(t.detach())).sum())
    if bad:
        raise contract_error(key, spec, f"{name} has {bad} non-finite value(s) (NaN or inf) of {t.numel()}; expected "
                               "finite values")
    return t


def custom_advantages(inputs: AdvantageInputs) -> torch.Tensor:
    """Call the custom estimator ``inputs.cfg.advantage`` and check its output.

    Returns:
        ``[B]`` or ``[B, T]`` float32 on CPU, 0 on rows outside ``inputs.scored`` and (``[B, T]``) off
        ``inputs.response_mask``.

    Raises:
        ObjectiveError: the function does not load, raises, or returns something other than a finite float32
            tensor of shape ``[B]`` or ``[B, T]`` (the message names the tensor and both shapes).
    """
    spec = inputs.cfg.advantage
    fn = load_objective("advantage", spec)
    mask = inputs.response_mask
    shapes = {"[B]": tuple(mask.shape[:1]), "[B, T]": tuple(mask.shape)}
    try:
        out = fn(inputs)
    except Exception as exc:
        raise contract_error("advantage", spec, f"raised {type(exc).__name__}: {exc}") from exc
    out = _check_tensor("advantage", spec, "the returned advantages tensor", out, shapes).detach().to("cpu")
    keep = inputs.scored if out.dim() == 1 else mask & inputs.scored.unsqueeze(1)
    return torch.where(keep, out, torch.zeros_like(out))


def custom_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: Any,
    normaliser: float,
    row_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The custom loss ``cfg.loss`` in place of ``learner.algo.losses.policy_loss`` (same arguments, same return).

    Returns:
        ``(loss, metrics)``: the function's 0-dim loss; its metrics as ``custom_loss/<name>``, plus
        ``is_ratio_mean``, ``is_ratio_max``, ``approx_kl`` of ``rho = exp(proximal - behaviour)`` and
        ``valid_tokens`` (``learner.algo.losses.ratio_metrics``).

    Raises:
        ObjectiveError: the function does not load, raises, or returns something other than a finite float32
            0-dim tensor that requires grad (optionally with a dict of real-number metrics).
    """
    spec = cfg.loss
    fn = load_objective("loss", spec)
    inputs = LossInputs(logprobs, proximal_logprobs.detach(), behaviour_logprobs.detach(), advantages.detach(), mask,
                        cfg, float(normaliser), row_scale)
    try:
        out = fn(inputs)
    except Exception as exc:
        raise contract_error("loss", spec, f"raised {type(exc).__name__}: {exc}") from exc
    loss, extra = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
    _check_tensor("loss", spec, "the returned loss", loss, {"[]": ()})
    if not loss.requires_grad:
        raise contract_error("loss", spec, "the returned loss does not require grad: it has no gradient path to "
                                  "inputs.logprobs")
    metrics = ratio_metrics(proximal_logprobs, behaviour_logprobs, mask)
    metrics.update(_metrics(spec, extra))
    return loss, metrics


def _metrics(spec: str, extra: Any) -> dict[str, float]:
    if not isinstance(extra, dict):
        raise contract_error("loss", spec, f"the returned metrics are a {type(extra).__name__}, not a dict of str -> float")
    out = {}
    for name, value in extra.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise contract_error("loss", spec, f"metric {name!r} = {value!r:.60} is not a finite real number under a str name")
        out[f"custom_loss/{name}"] = float(value)
    return out
