"""Reward functions by name, each with a version string recorded on every trajectory it scores.

Names:

- ``reasoning_gym:<dataset>`` for any reasoning-gym dataset: the dataset's own ``score_answer`` on
  the answer extracted from the response (param ``extract``: ``last_integer`` — gyre's original rule —,
  ``answer_tag`` — the last ``<answer>…</answer>``, reasoning-gym's ``extract_answer`` — or ``full`` — the
  stripped response). Exact by default: 1.0 iff ``score_answer`` gives 1.0, else 0.0 (version
  ``rg-last-int-exact-v1`` / ``rg-answer-tag-exact-v1`` / ``rg-full-exact-v1``). reasoning-gym's default
  ``score_answer`` gives partial credit when the oracle is a substring of the answer (``"15"`` or ``"-5"``
  for oracle ``"5"`` score 0.5), which GRPO's group normalisation turns into a positive advantage for a
  wrong answer; param ``partial_credit: true`` keeps that score (versions ``rg-last-int-v1``, ...).
- ``math_exact``: exact match after normalisation against ``entry["answer"]`` (``math_exact.py``); 0 or 1.
- ``math_verify``: Hugging Face ``math-verify`` on LaTeX/boxed answers, as TRL's ``accuracy_reward``
  (``verify_math.py``); 0 or 1.
- ``humaneval``: the completion plus the problem's tests run in the sandbox (``sandbox.py``);
  1.0 iff every test passes.
- ``char_fraction``: a dense shaping score, the fraction of the response's characters that are in
  ``params.chars``. Every response earns a graded score, so GRPO's group-normalised advantages are non-zero
  even for a randomly initialised model; gyre's smoke-test recipes (``deploy/recipes/tiny-*.yaml``) use it so
  that every learner step moves the weights.

Plain Python functions with TRL's calling convention are ``{function: "pkg.module:fn"}`` or
``{function: "path/to/file.py:fn"}`` (``function.py``); several rewards combine as a weighted sum
(``combined.py``).

A scorer never kills its caller: ``RewardFn.score`` turns an exception into reward 0.0 with a
``reward_error`` (``raised: <Type>: <message>``); the sandbox's timeout/memory/forbidden/error
outcomes of a code reward are reported the same way (``sandbox-<status>: <detail>``).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Callable, Literal

import reasoning_gym
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gyre.rollout.rewards.base import RewardConfig, RewardFn
from gyre.rollout.rewards.code import build_program, check_problem
from gyre.rollout.rewards.math_exact import MATH_EXACT_VERSION, math_exact_match
from gyre.rollout.rewards.sandbox import SandboxConfig, run_python

RG_PREFIX = "reasoning_gym:"


class UnknownRewardError(ValueError):
    """The reward name is not registered; the message lists the known ones."""


def extract_last_integer(text: str) -> str | None:
    """The last integer in ``text`` (commas inside numbers are removed first), or ``None``."""
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return found[-1] if found else None


class _RGParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    extract: Literal["last_integer", "answer_tag", "full"] = "last_integer"
    partial_credit: bool = False
    """``False``: 1.0 iff ``score_answer`` is 1.0, else 0.0. ``True``: ``score_answer`` as it is (graded)."""


_RG_EXTRACT: dict[str, tuple[str, Callable[[str], str | None]]] = {
    "last_integer": ("rg-last-int", extract_last_integer),
    "answer_tag": ("rg-answer-tag", lambda text: reasoning_gym.utils.extract_answer(text)),
    "full": ("rg-full", lambda text: text.strip() or None),
}


class ReasoningGymReward(RewardFn):
    """``reasoning_gym:<dataset>``: the dataset's ``score_answer`` on the extracted answer; 0/1 unless
    ``partial_credit``. Version ``rg-<extract>-exact-v1`` (exact) or ``rg-<extract>-v1`` (partial credit)."""

    def __init__(self, dataset_name: str, params: _RGParams, dataset=None) -> None:
        self.name = RG_PREFIX + dataset_name
        stem, self._extract = _RG_EXTRACT[params.extract]
        self.partial_credit = params.partial_credit
        self.version = f"{stem}-v1" if params.partial_credit else f"{stem}-exact-v1"
        self._score_answer = (dataset.score_answer if dataset is not None
                              else reasoning_gym.get_score_answer_fn(dataset_name))

    def _score(self, response: str, entry: dict) -> tuple[float, str]:
        answer = self._extract(response)
        score = 0.0 if answer is None else float(self._score_answer(answer, entry))
        return (score if self.partial_credit else float(score == 1.0)), ""


class _NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MathExactReward(RewardFn):
    """``math_exact``: 1.0 iff the final answer equals ``entry["answer"]`` after normalisation."""

    name, version = "math_exact", MATH_EXACT_VERSION

    def _score(self, response: str, entry: dict) -> tuple[float, str]:
        return float(math_exact_match(response, entry["answer"])), ""


class _HumanEvalParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    sandbox: SandboxConfig = SandboxConfig()
    """Limits of each sandboxed run."""


class HumanEvalReward(RewardFn):
    """``humaneval``: 1.0 iff the completion passes all of the problem's tests in the sandbox."""

    name, version = "humaneval", "humaneval-sandbox-v1"

    def __init__(self, params: _HumanEvalParams) -> None:
        self.sandbox = params.sandbox

    def check_entry(self, entry: dict) -> None:
        check_problem(entry)

    def _score(self, response: str, entry: dict) -> tuple[float, str]:
        result = run_python(build_program(response, entry), self.sandbox)
        if result.status in ("ok", "failed"):
            return float(result.passed), ""
        return 0.0, f"sandbox-{result.status}: {result.detail}"[:500]


class _CharFractionParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    chars: str = Field(min_length=1)
    """The characters that score (each counted once, order irrelevant), e.g. ``"0123456789 "``."""


class CharFractionReward(RewardFn):
    """``char_fraction``: ``|{i : response[i] in chars}| / len(response)`` (0.0 for an empty response).

    A dense, graded reward: two different responses almost never tie, so a group's rewards have non-zero
    variance and its GRPO advantages are non-zero from the first step, for any model. Reads nothing of the
    problem entry. Version ``char-fraction-v1:<sha256 of the sorted character set, 12 hex>``.
    """

    name = "char_fraction"

    def __init__(self, params: _CharFractionParams) -> None:
        self.chars = frozenset(params.chars)
        digest = hashlib.sha256("".join(sorted(self.chars)).encode()).hexdigest()[:12]
        self.version = f"char-fraction-v1:{digest}"

    def check_entry(self, entry: dict) -> None:
        """Any entry: the score depends on the response only."""

    def _score(self, response: str, entry: dict) -> tuple[float, str]:
        if not response:
            return 0.0, ""
        return sum(ch in self.chars for ch in response) / len(response), ""


def _params(model: type[BaseModel], name: str, params: dict) -> BaseModel:
    try:
        return model.model_validate(params)
    except ValidationError as exc:
        raise ValueError(f"reward {name!r}: bad params {params}: {exc}") from exc


def _math_exact(cfg: RewardConfig, dataset) -> RewardFn:
    _params(_NoParams, cfg.name, cfg.params)
    return MathExactReward()


def _math_verify(cfg: RewardConfig, dataset) -> RewardFn:
    from gyre.rollout.rewards.verify_math import MathVerifyReward  # imports sympy: only when asked for

    _params(_NoParams, cfg.name, cfg.params)
    return MathVerifyReward()


def _humaneval(cfg: RewardConfig, dataset) -> RewardFn:
    return HumanEvalReward(_params(_HumanEvalParams, cfg.name, cfg.params))


def _char_fraction(cfg: RewardConfig, dataset) -> RewardFn:
    return CharFractionReward(_params(_CharFractionParams, cfg.name, cfg.params))


_FACTORIES: dict[str, Callable[[RewardConfig, Any], RewardFn]] = {
    "math_exact": _math_exact, "math_verify": _math_verify, "humaneval": _humaneval, "char_fraction": _char_fraction}


def register_reward(name: str, factory: Callable[[RewardConfig, Any], RewardFn]) -> None:
    """Add a reward factory ``(config, dataset_or_None) -> RewardFn`` under ``name``."""
    if name in _FACTORIES or name.startswith(RG_PREFIX):
        raise ValueError(f"reward name {name!r} is already taken")
    _FACTORIES[name] = factory


def known_rewards() -> list[str]:
    """Registered names; ``reasoning_gym:<dataset>`` stands for every reasoning-gym dataset."""
    return sorted(_FACTORIES) + [RG_PREFIX + "<dataset>"]


def make_reward(config: RewardConfig | str | dict, dataset=None):
    """Build the reward function named by ``config``: a ``RewardFn`` (scores one response at a time), for
    ``function`` a ``rollout.rewards.function.FunctionReward`` (one call per group), for ``model`` a
    ``rollout.rewards.model.ModelReward`` (scored by the reward-model service). Both have ``name``,
    ``version``, ``timeout_s``, ``check_entry(entry)`` and ``async score_groups(groups)``.

    Args:
        config: a ``RewardConfig`` (or its dict / bare-name form).
        dataset: for ``reasoning_gym:*``, the task's dataset instance whose ``score_answer`` is used
            (default: one built with the dataset's default config).
    Raises:
        UnknownRewardError: unknown name (the message lists the known ones / the reasoning-gym datasets).
        rollout.rewards.function.RewardImportError: a ``function`` that does not load (path, attribute,
            signature).
        rollout.rewards.model.RewardModelError: a ``model`` that does not resolve or fit its ``kind``.
        ValueError: params that do not fit the reward.
    """
    cfg = config if isinstance(config, RewardConfig) else RewardConfig.model_validate(config)
    if cfg.function is not None:
        from gyre.rollout.rewards.function import FunctionReward  # its own imports: only for a function

        return FunctionReward(cfg)
    if cfg.model is not None:
        from gyre.rollout.rewards.model import ModelReward  # scored by the reward-model service

        return ModelReward(cfg)
    if cfg.name.startswith(RG_PREFIX):
        ds_name = cfg.name[len(RG_PREFIX):]
        if ds_name not in reasoning_gym.factory.DATASETS:
            raise UnknownRewardError(f"unknown reward {cfg.name!r}: {ds_name!r} is not a reasoning-gym dataset; "
                                     f"reasoning-gym has: {', '.join(sorted(reasoning_gym.factory.DATASETS))}")
        reward: RewardFn = ReasoningGymReward(ds_name, _params(_RGParams, cfg.name, cfg.params), dataset)
    elif cfg.name in _FACTORIES:
        reward = _FACTORIES[cfg.name](cfg, dataset)
    else:
        raise UnknownRewardError(f"unknown reward {cfg.name!r}; known: {', '.join(known_rewards())}")
    reward.timeout_s = cfg.timeout_s
    return reward
