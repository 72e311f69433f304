"""Exact-match math answers after normalisation (reward ``math_exact``).

Rules, applied in this order (the version string ``MATH_EXACT_VERSION`` changes when they do):

1. **Extraction** from the response: the content of the last ``\\boxed{...}`` (braces balanced) if
   there is one; otherwise the last number in the text (``-12``, ``3.50``, ``1,234``, ``3/4``); otherwise
   the whole response. The reference answer is only normalised, not extracted.
2. **Normalisation** of both sides: strip surrounding whitespace; unwrap a whole-string ``\\boxed{x}``;
   remove ``$``, ``\\(``, ``\\)``, ``\\[``, ``\\]`` and ``\\!``; ``\\frac{a}{b}`` / ``\\dfrac`` / ``\\tfrac`` →
   ``a/b``; remove thousands separators (a comma between a digit and exactly three digits:
   ``1,234,567`` → ``1234567``, but ``(1,2)`` stays); drop one trailing ``.`` (sentence end); remove
   all remaining whitespace.
3. **Comparison**: when both sides parse as numbers — integer, decimal, or a fraction of two of them —
   they are compared exactly as rationals (``fractions.Fraction``), so ``3.0 == 3``, ``0.5 == 1/2``,
   ``-2/4 == -0.5`` (this is where a trailing ``.0`` stops mattering). Otherwise the normalised strings
   must be equal (case-sensitive).

The scheme follows the answer normalisation common in MATH/GSM8K graders (Hendrycks et al. 2021,
"Measuring Mathematical Problem Solving With the MATH Dataset"), reduced to exact rational equality:
no symbolic algebra, no units, no percent handling.
"""

from __future__ import annotations

import re
from fractions import Fraction

MATH_EXACT_VERSION = "math-exact-v1"

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_NUMBER_RE = re.compile(rf"{_NUMBER}(?:\s*/\s*{_NUMBER})?|{_NUMBER}")
_NUMERIC_RE = re.compile(rf"^{_NUMBER}(?:/{_NUMBER})?$")
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (nested braces allowed), or ``None``."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: no usable box


def extract_final_answer(response: str) -> str:
    """Rule 1: last ``\\boxed{}`` content, else the last number, else the whole response."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    numbers = _NUMBER_RE.findall(_THOUSANDS_RE.sub("", response))
    return numbers[-1] if numbers else response


def normalize(answer: str) -> str:
    """Rule 2 (see the module docstring), e.g. ``" $\\boxed{1,234.}$ "`` → ``"1234"``."""
    s = answer.strip()
    for token in ("$", "\\(", "\\)", "\\[", "\\]", "\\!"):
        s = s.replace(token, "")
    s = s.strip()
    boxed = last_boxed(s)
    if boxed is not None and s.startswith("\\boxed{") and s.endswith("}"):
        s = boxed
    s = _FRAC_RE.sub(r"\1/\2", s)
    s = _THOUSANDS_RE.sub("", s)
    s = s.strip()
    if s.endswith("."):
        s = s[:-1]
    return "".join(s.split())


def as_number(text: str) -> Fraction | None:
    """The exact rational value of a normalised integer/decimal/fraction string, or ``None``."""
    if not _NUMERIC_RE.match(text):
        return None
    num, _, den = text.partition("/")
    try:
        value = Fraction(num) / Fraction(den) if den else Fraction(num)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def math_exact_match(response: str, reference: str) -> bool:
    """Rules 1–3: does the response's final answer equal ``reference``?"""
    got, want = normalize(extract_final_answer(response)), normalize(str(reference))
    got_n, want_n = as_number(got), as_number(want)
    if got_n is not None and want_n is not None:
        return got_n == want_n
    return got == want
