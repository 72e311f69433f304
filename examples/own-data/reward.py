"""This example's reward: a plain Python function with TRL's calling convention (gyre imports it in each rollout).

gyre calls it once per group: ``completions`` are the group's ``n`` response texts, ``prompts`` the chat messages
each answered, and every other column of the dataset row arrives as a list of ``n`` values (here ``solution`` and
``difficulty``). It returns one float per completion; ``None`` would mark a completion it cannot score (a failed
score: recorded on the trajectory as ``reward_error`` and left out of training).
"""

from __future__ import annotations

import re


def exact_integer(completions: list[str], *, prompts, solution: list[str], **columns) -> list[float | None]:
    """1.0 when the last integer of a completion equals ``solution``, else 0.0 (no partial credit)."""
    scores: list[float | None] = []
    for text, gold in zip(completions, solution, strict=True):
        found = re.findall(r"-?\d+", text.replace(",", ""))
        scores.append(1.0 if found and int(found[-1]) == int(gold) else 0.0)
    return scores
