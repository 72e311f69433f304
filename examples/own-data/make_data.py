"""Write this example's data: ``train.jsonl`` (2000 problems) and ``eval.jsonl`` (128, none of them in train).

The problems come from reasoning-gym's ``basic_arithmetic`` generator (2 terms, 1-2 digits, + and -, natural
phrasing such as "What is 5 - 9?"), with the instruction appended. Each row has the columns ``problem``,
``solution`` and ``difficulty`` (the number of digits), named differently from gyre's defaults on purpose: the
recipe maps them (``columns: {prompt: problem, answer: solution}``), and ``difficulty`` reaches the reward.

Run from the repository root: ``.venv/bin/python examples/own-data/make_data.py``. Deterministic (seeded).
"""

from __future__ import annotations

import json
from pathlib import Path

import reasoning_gym

HERE = Path(__file__).resolve().parent
PARAMS = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=["+", "-"], allow_parentheses=False,
              allow_negation=False, format_style="natural")
SUFFIX = "Give only the final number."


def rows(seed: int, size: int, skip: set[str]) -> list[dict]:
    """``size`` distinct problems of the generator seeded ``seed`` whose question is not in ``skip``."""
    data = reasoning_gym.create_dataset("basic_arithmetic", seed=seed, size=4 * size, **PARAMS)
    out, seen = [], set(skip)
    for i in range(len(data)):
        question = data[i]["question"]
        if question in seen:
            continue
        seen.add(question)
        digits = max(len(t) for t in question.replace("?", " ").replace(".", " ").split() if t.isdigit())
        out.append({"problem": f"{question} {SUFFIX}", "solution": data[i]["answer"], "difficulty": digits})
        if len(out) == size:
            return out
    raise RuntimeError(f"only {len(out)} distinct problems for seed {seed}")


def main(out: Path = HERE) -> None:
    """Write ``train.jsonl`` and ``eval.jsonl`` into ``out``."""
    evaluation = rows(seed=7, size=128, skip=set())
    train = rows(seed=1, size=2000, skip={r["problem"].removesuffix(f" {SUFFIX}") for r in evaluation})
    for name, data in (("train", train), ("eval", evaluation)):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in data)
        print(f"{name}.jsonl: {len(data)} rows")


if __name__ == "__main__":
    main()
