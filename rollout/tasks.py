"""Task sources: deterministic prompt streams from reasoning-gym, scored by the task's own verifier.

A ``TaskSource`` maps a prompt index (handed out by replay's prompt ledger) to one problem. The
training stream and the held-out evaluation set use different seeds, and training items whose
question also appears in the held-out set are skipped, so the two are disjoint.
"""

from __future__ import annotations

import re
from typing import Any

import reasoning_gym
from pydantic import BaseModel, ConfigDict, Field

REWARD_FN_VERSION = "rg-last-int-v1"
"""Recorded on every trajectory; bump when the answer extraction or scoring changes."""

_INT_RE = re.compile(r"-?\d+")


class TaskConfig(BaseModel):
    """Which reasoning-gym task, at which difficulty, and how it is phrased and scored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "basic_arithmetic"
    """A reasoning-gym dataset name (``reasoning_gym.factory.DATASETS``)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the dataset's config class (difficulty knobs)."""
    prompt_suffix: str = "Give only the final number."
    """Appended to each question (after a space)."""
    system_prompt: str | None = None
    """Replaces the chat template's default system prompt when set."""
    seed: int = 1
    """Seed of the training prompt stream."""
    size: int = Field(100_000, ge=1)
    """Number of distinct training problems the stream draws from."""
    heldout_seed: int = 7
    """Seed of the held-out evaluation set (disjoint from training)."""
    heldout_size: int = Field(128, ge=1)
    """Number of held-out problems scored greedily before and after training."""


class UnknownTaskError(ValueError):
    """The task name is not a reasoning-gym dataset."""


def extract_last_integer(text: str) -> str | None:
    """The last integer in ``text`` (commas inside numbers are removed first), or ``None``."""
    found = _INT_RE.findall(text.replace(",", ""))
    return found[-1] if found else None


class TaskSource:
    """Deterministic prompt stream + held-out set for one reasoning-gym task.

    Raises:
        UnknownTaskError: ``config.name`` is not a reasoning-gym dataset.
        ValueError: ``config.params`` do not fit the dataset's config (message from reasoning-gym).
    """

    def __init__(self, config: TaskConfig) -> None:
        self.config = config
        names = sorted(reasoning_gym.factory.DATASETS)
        if config.name not in names:
            raise UnknownTaskError(f"unknown task {config.name!r}; reasoning-gym has: {', '.join(names)}")
        self._train = self._make(config.seed, config.size)
        self._heldout = self._make(config.heldout_seed, config.heldout_size)
        self._heldout_questions = {self._heldout[i]["question"] for i in range(config.heldout_size)}
        self._train_map: list[int] = []
        self._cursor = 0

    def _make(self, seed: int, size: int):
        try:
            return reasoning_gym.create_dataset(self.config.name, seed=seed, size=size, **self.config.params)
        except TypeError as exc:
            raise ValueError(f"task {self.config.name!r}: bad params {self.config.params}: {exc}") from exc

    def _train_entry(self, prompt_index: int) -> dict:
        """The ``prompt_index``-th training problem not in the held-out set."""
        while len(self._train_map) <= prompt_index:
            if self._cursor >= 10 * self.config.size:
                raise IndexError(f"task {self.config.name!r} ran out of training problems at {prompt_index}")
            i = self._cursor % self.config.size
            self._cursor += 1
            if self._train[i]["question"] not in self._heldout_questions:
                self._train_map.append(i)
        return self._train[self._train_map[prompt_index]]

    def messages(self, question: str) -> list[dict[str, str]]:
        """Chat messages for one problem."""
        msgs = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        suffix = f" {self.config.prompt_suffix}" if self.config.prompt_suffix else ""
        return msgs + [{"role": "user", "content": question + suffix}]

    def train_problem(self, prompt_index: int) -> dict:
        """reasoning-gym entry (``question``, ``answer``, ``metadata``) for a training prompt index."""
        if prompt_index < 0:
            raise IndexError(f"prompt_index ({prompt_index}) must be >= 0")
        return self._train_entry(prompt_index)

    def heldout_problems(self) -> list[dict]:
        """The fixed held-out set, in order."""
        return [self._heldout[i] for i in range(self.config.heldout_size)]

    def score(self, response_text: str, entry: dict) -> float:
        """Reward in [0, 1]: the task's ``score_answer`` on the last integer of the response."""
        answer = extract_last_integer(response_text)
        if answer is None:
            return 0.0
        return float(self._train.score_answer(answer, entry))
