"""``math_verify``: Hugging Face ``math-verify`` on LaTeX/boxed answers, configured as TRL's ``accuracy_reward``.

- The gold ``entry["answer"]`` is parsed with math-verify's default extraction (LaTeX, then a plain
  expression: ``"5"``, ``"\\frac{1}{3}"``, ``"$x^2$"``).
- The response is parsed with LaTeX extraction only, the last ``\\boxed{}`` tried first and an anchor
  required (``\\boxed{...}``, ``$...$``, "final answer is ..."); unit words are normalised away.
- 1.0 iff ``verify(gold, answer)`` (symbolic equality, numbers to 6 decimals), else 0.0.
- A gold answer that does not parse is no verdict: reward 0.0 with ``reward_error`` (TRL returns ``None``).

math-verify bounds each parse and verify with ``signal.alarm``, which raises off the main thread; gyre
scores in a thread pool, so its own timeouts are turned off (``parsing_timeout=None``,
``timeout_seconds=None``) and the scoring pool's ``timeout_s`` bounds the call instead.
"""

from __future__ import annotations

import logging

from gyre.rollout.rewards.base import RewardFn

MATH_VERIFY_VERSION = "math-verify-v1"


class MathVerifyReward(RewardFn):
    """``math_verify``: 1.0 iff the response's boxed/LaTeX answer is mathematically equal to ``entry["answer"]``."""

    name, version = "math_verify", MATH_VERIFY_VERSION

    def __init__(self) -> None:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify

        # the "Timeout is disabled" warnings it logs on every call when its own timeouts are off
        logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
        logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
        self._parse, self._verify = parse, verify
        self._answer_config = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                                     boxed_match_priority=0, try_extract_without_anchor=False)]

    def _score(self, response: str, entry: dict) -> tuple[float, str]:
        gold = self._parse(str(entry["answer"]), parsing_timeout=None)
        if not gold:
            return 0.0, f"gold answer {str(entry['answer'])[:100]!r} does not parse"
        answer = self._parse(response, extraction_config=self._answer_config, extraction_mode="first_match",
                             parsing_timeout=None)
        return float(self._verify(gold, answer, timeout_seconds=None)), ""
