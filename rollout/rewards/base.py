"""What every reward shares: its config (``RewardConfig``), its result (``RewardResult``), what it is called
with (``Group``), the built-in scorer's base class (``RewardFn``) and the thread pool that scores off the event
loop (``score_many``).

Code rewards take 0.1–2 s each and the rollout's asyncio loop must not wait: responses are scored concurrently
in one small thread pool shared by the process (threads, not processes: the sandbox starts its own child with
fork+exec, and nothing here forks Python after gRPC was used). A scorer that overruns its budget yields reward
0.0 with ``reward_error = "timeout: ..."``; its thread cannot be killed and finishes on its own (the sandbox
bounds code rewards, so only a hung in-process scorer can hold a pool thread).

Every other reward module imports this one and it imports none of them (``registry`` builds rewards by name,
``function`` wraps plain functions, ``combined`` sums them, ``scoring`` scores a task's groups).
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RewardConfig(BaseModel):
    """Which reward function scores a task, with its parameters. A bare string means ``{name: ...}``.

    Exactly one of ``name`` (a built-in reward), ``function`` (a plain Python function) and ``model`` (a reward
    model served by the run's reward-model service) is set.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    """A registered name: ``reasoning_gym:<dataset>``, ``math_exact``, ``math_verify``, ``humaneval`` or
    ``char_fraction``."""
    function: str | None = None
    """``"pkg.module:fn"`` (importable in every rollout actor: on a cluster ship it with ``ray.runtime_env``)
    or ``"path/to/file.py:fn"`` (a recipe resolves a relative path against the recipe's folder) — a function
    ``fn(completions: list[str], *, prompts, **columns) -> list[float | None]``, sync or async, called once per
    group (``rollout.rewards.function``)."""
    model: str | None = None
    """A reward model: a local Hugging Face model folder or a Hub id (resolved in the local HF cache, or downloaded
    where the Hub is reachable), scored by the run's reward-model service (``rollout.rewards.model``); its
    revision is the reward version."""
    kind: Literal["classifier", "judge"] = "classifier"
    """For a ``model``: ``classifier`` — an ``AutoModelForSequenceClassification`` (the usual RLHF reward model:
    one logit per response) — or ``judge`` — a generative model served by vLLM, prompted with ``params.template``
    and its reply parsed with ``params.parser``."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Parameters of that reward (validated by its own model, unknown keys refused); for a ``function``,
    extra keyword arguments of every call (verl's ``reward_kwargs``; TRL passes none)."""
    weight: float = 1.0
    """Factor of this reward in the weighted sum of a task's ``rewards`` (TRL's ``reward_weights``)."""
    timeout_s: float = Field(30.0, gt=0)
    """Budget in seconds for scoring one response (a ``function``: for one call, i.e. one group; a ``model``: the
    deadline of one scoring request, retried meanwhile while the reward-model service restarts); past it the
    sample gets reward 0.0 and ``reward_error = "timeout: ..."`` (an in-process scorer's thread cannot be
    killed and runs on)."""

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _one_kind(self) -> "RewardConfig":
        given = [k for k in ("name", "function", "model") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("a reward sets exactly one of name (a built-in reward), function ('pkg.module:fn' or "
                             "'file.py:fn') and model (a reward model's folder or Hub id); got "
                             f"name={self.name!r}, function={self.function!r}, model={self.model!r}")
        if self.model is None and self.kind != "classifier":
            raise ValueError(f"kind ({self.kind!r}) applies to a model reward only; set model too")
        if not math.isfinite(self.weight):
            raise ValueError(f"weight ({self.weight}) must be finite")
        return self

    @property
    def label(self) -> str:
        """Short name of this reward in metrics: the built-in name, or ``module:fn`` / ``file.py:fn``."""
        if self.model is not None:
            return f"rm:{self.model.replace(chr(92), '/').rstrip('/').rsplit('/', 1)[-1]}"
        return self.name if self.name is not None else self.function.replace("\\", "/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class RewardResult:
    """The reward of one response and where it came from."""

    reward: float
    """Built-in rewards: in [0, 1]; a ``function`` or a weighted sum: any finite float. 0.0 when ``error`` is
    set."""
    version: str
    """Version of the reward function (``reward_fn_version`` on the trajectory)."""
    error: str = ""
    """``""`` when the verifier reached a verdict, else why it did not (``reward_error``)."""
    abstained: bool = False
    """A reward function returned ``None`` for this response (``error`` says so): TRL's NaN. In a weighted sum
    (``rollout.rewards.combined``) the other rewards still score the row; alone, the row has no score."""


class RewardFn(ABC):
    """A named, versioned scorer: ``(response text, problem entry) -> reward in [0, 1]``."""

    name: str
    version: str
    timeout_s: float = 30.0

    @abstractmethod
    def _score(self, response: str, entry: dict) -> tuple[float, str]:
        """(reward, error) for one response; may raise (``score`` records it)."""

    def check_entry(self, entry: dict) -> None:
        """Raise ``KeyError`` if ``entry`` lacks what this scorer reads."""
        if "answer" not in entry:
            raise KeyError(f"reward {self.name!r} needs entry['answer']; got keys {sorted(entry)}")

    def score(self, response: str, entry: dict) -> RewardResult:
        """Score one response; never raises: a failure gives reward 0.0 and a non-empty ``error``."""
        try:
            reward, error = self._score(response, entry)
            reward = float(reward)
            if not math.isfinite(reward):
                raise ValueError(f"reward {reward} is not finite")
        except Exception as exc:  # recovery path: a bad scorer costs one sample, not the worker
            return RewardResult(0.0, self.version, f"raised: {type(exc).__name__}: {exc}"[:500])
        return RewardResult(0.0 if error else reward, self.version, error)

    async def score_groups(self, groups: list[Group]) -> list[list[RewardResult]]:
        """Score every response of each ``Group`` (one call of ``score`` per response, in the scoring pool:
        ``score_many``); results per group, in order."""
        flat = await score_many([(self, text, g.entry) for g in groups for text in g.completions])
        out, i = [], 0
        for g in groups:
            out.append(flat[i:i + len(g.completions)])
            i += len(g.completions)
        return out


@dataclass(frozen=True)
class Group:
    """What a reward is called with: the ``n`` completions of one prompt."""

    completions: list[str]
    """``[n]`` response texts."""
    prompts: list[Any]
    """``[n]`` chat messages (``list[dict[str, str]]``) each completion answered."""
    entry: dict
    """The problem entry (its keys are the reward's columns)."""
    completion_ids: list[list[int]] = field(default_factory=list)
    """``[n][T_i]`` response token ids (empty: not known)."""


_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
POOL_THREADS = max(2, min(8, os.cpu_count() or 2))
"""Threads scoring at once (each code reward runs one sandboxed process)."""


def scoring_pool() -> ThreadPoolExecutor:
    """The process's scoring thread pool (``POOL_THREADS`` threads, created on first use)."""
    global _POOL
    with _LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix="gyre-reward")
        return _POOL


async def score_many(items: list[tuple[RewardFn, str, dict]]) -> list[RewardResult]:
    """Score ``(reward_fn, response_text, entry)`` triples concurrently; results in input order.

    Never raises for a scorer's failure: each result carries reward 0.0 and a non-empty ``error``
    when its scorer raised or did not finish within ``timeout_s × ceil(len(items) / POOL_THREADS)``
    seconds (its own budget, scaled for the queueing of a batch larger than the pool).
    """
    loop = asyncio.get_running_loop()
    scale = math.ceil(len(items) / POOL_THREADS)

    async def one(fn: RewardFn, text: str, entry: dict) -> RewardResult:
        budget = fn.timeout_s * scale
        try:
            return await asyncio.wait_for(loop.run_in_executor(scoring_pool(), fn.score, text, entry), budget)
        except asyncio.TimeoutError:
            return RewardResult(0.0, fn.version, f"timeout: not scored within {budget:.1f} s")

    return list(await asyncio.gather(*(one(fn, text, entry) for fn, text, entry in items)))
