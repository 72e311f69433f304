"""Rewards as plain Python functions with TRL's calling convention (``reward: {function: ...}``).

A recipe names the function as ``"pkg.module:fn"`` (imported with ``importlib``; on a cluster the module
travels to the rollout actors with the recipe's ``ray.runtime_env``: ``working_dir`` / ``py_modules``) or
``"path/to/file.py:fn"`` (executed from that file; a recipe resolves a relative path against its own
folder, so the file must be readable at that absolute path on every rollout node). It is imported in the
driver when the recipe loads (a bad path or signature is refused before anything starts) and again in
each rollout actor.

The call, once per group of ``n`` completions of one prompt, every argument by keyword as TRL's
``GRPOTrainer`` calls ``reward_funcs``::

    fn(completions=..., prompts=..., completion_ids=..., **columns, **params) -> list[float | None]

- ``completions``: the ``n`` responses. As in TRL, their form follows the data's: ``list[str]`` (the response
  texts) for a standard entry, and ``list[list[dict]]`` (``[{"role": "assistant", "content": text}]`` each) for a
  conversational one — an entry with a column holding chat messages (a list of ``{role, content}`` dicts, TRL's
  ``is_conversational``), such as a dataset whose prompt column is messages.
- ``prompts``: ``list[list[dict[str, str]]]``, per completion the chat messages it answered (TRL's
  conversational prompt form; the same list ``n`` times).
- ``completion_ids``: ``list[list[int]]``, the response token ids (as TRL passes them).
- ``columns``: every key of the problem entry (reasoning-gym: ``question``, ``answer``, ``metadata``; a
  dataset: its columns) as a list of ``n`` equal values; entry keys named ``completions``, ``prompts`` or
  ``completion_ids`` are not passed.
- ``params``: the reward's ``params``, as plain keyword arguments (verl's ``reward_kwargs``; TRL passes
  none); a param may not share a name with the above.

The function may be ``async def`` (run on one background event loop per process, never on the rollout's
loop); a sync one runs in the scoring thread pool. It returns ``n`` scores; a score may be any finite float.
``None`` is "no verdict" (TRL's NaN): with several rewards (``task.rewards``) the others still score the row,
summed as TRL's ``nansum``; a row none of them scored, or a lone reward's ``None``, fails. A non-number, NaN, a
wrong count, an exception or overrunning ``timeout_s`` (per call) is a failed score: reward 0.0 and a
``reward_error`` on the affected trajectories, never an error of the worker. (TRL stops training on an
exception instead.) Not passed: TRL's ``trainer_state`` (gyre has no ``Trainer``; a function that requires it is
refused at load, one that takes ``**kwargs`` never sees it).

Version: ``fn:<label>:<sha256 of the source file's bytes + the canonical JSON of {fn, params}, 12 hex>``
(``label``: ``module:fn`` or ``file.py:fn``), so an edited file or other params give another version. Only
the file that defines the named module is hashed, not modules it imports. A module already imported whose
file changed since gyre last loaded it is reloaded (its new source executed into the module, as
``importlib.reload`` does); a file path is executed afresh on every load (each ``swap_reward``).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import math
import numbers
import threading
from typing import Any, Callable

from gyre.utils import callable_spec
from gyre.utils.callable_spec import CallableSpecError
from gyre.rollout.rewards.base import POOL_THREADS, Group, RewardConfig, RewardResult, scoring_pool

EXPECTED = ("'pkg.module:fn' or 'path/to/file.py:fn' naming a callable "
            "fn(completions, prompts, **kwargs) -> list[float | None], called by keyword")
RESERVED = ("completions", "prompts", "completion_ids")
"""Keyword names gyre passes itself; entry columns of these names are not passed."""


class RewardImportError(ValueError):
    """A reward function that cannot be loaded; the message names the path and what was expected."""


def _fail(spec: str, what: str) -> RewardImportError:
    return RewardImportError(f"reward function {spec!r}: {what}; expected {EXPECTED}")


def split_spec(spec: str) -> tuple[str, str]:
    """``"a.b:fn"`` → ``("a.b", "fn")``; ``"dir/r.py:fn"`` → ``("dir/r.py", "fn")`` (``utils.callable_spec``).

    Raises:
        RewardImportError: no ``:``, an empty part, or an attribute that is not a dotted identifier.
    """
    try:
        return callable_spec.split_spec(spec)
    except CallableSpecError as exc:
        raise _fail(spec, str(exc)) from None


def load_function(spec: str) -> tuple[Callable, bytes]:
    """Import the function named by ``spec`` (``utils.callable_spec.load_callable``); returns it and the source
    bytes of its file.

    Raises:
        RewardImportError: bad form, missing file, a module or file that does not import, a missing
            attribute, something not callable, or a signature that cannot take ``(completions=..., prompts=...)``.
    """
    try:
        fn, source = callable_spec.load_callable(spec)
    except CallableSpecError as exc:
        raise _fail(spec, str(exc)) from None
    attr = spec.rpartition(":")[2]
    try:
        inspect.signature(fn).bind_partial(completions=["completion"], prompts=[[]])
    except TypeError as exc:
        raise _fail(spec, f"{attr}{inspect.signature(fn)} cannot be called as fn(completions=..., prompts=...): "
                          f"{exc}") from None
    except ValueError:  # no signature to inspect (some builtins): the call will tell
        pass
    return fn, source


def is_async(fn: Callable) -> bool:
    """``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


_ASYNC_LOCK = threading.Lock()
_ASYNC_LOOP: asyncio.AbstractEventLoop | None = None


def _async_loop() -> asyncio.AbstractEventLoop:
    """One background event loop per process for ``async def`` rewards (created on first use)."""
    global _ASYNC_LOOP
    with _ASYNC_LOCK:
        if _ASYNC_LOOP is None:
            _ASYNC_LOOP = asyncio.new_event_loop()
            threading.Thread(target=_ASYNC_LOOP.run_forever, name="gyre-reward-async", daemon=True).start()
        return _ASYNC_LOOP


async def _awaited(awaitable):
    return await awaitable


def is_conversational(entry: dict) -> bool:
    """Whether a problem entry is conversational data in TRL's sense (``trl.data_utils.is_conversational``): one
    of its columns holds chat messages, a non-empty list of dicts each with ``role`` and ``content``."""
    return any(isinstance(v, list) and v and all(isinstance(m, dict) and "role" in m and "content" in m for m in v)
               for v in entry.values())


def check_scores(out: Any, n: int, version: str) -> list[RewardResult]:
    """A function's return value → ``n`` results; a bad value fails the rows it concerns (all for a bad
    container or count)."""
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        return [RewardResult(0.0, version, f"returned: {type(out).__name__}, expected a list of {n} "
                                           "floats or None")] * n
    scores = list(out)
    if len(scores) != n:
        return [RewardResult(0.0, version, f"returned: {len(scores)} scores for {n} completions")] * n
    results = []
    for x in scores:
        if x is None:
            results.append(RewardResult(0.0, version, "returned: None (no verdict)", abstained=True))
        elif not isinstance(x, numbers.Real):
            results.append(RewardResult(0.0, version, f"returned: {type(x).__name__} {x!r:.60}, not a number"))
        elif not math.isfinite(float(x)):
            results.append(RewardResult(0.0, version, f"returned: {float(x)}, not finite"))
        else:
            results.append(RewardResult(float(x), version))
    return results


class FunctionReward:
    """A reward given as ``{function: spec}``: ``name``, ``version``, ``timeout_s``, ``check_entry`` and
    ``score_groups`` as a built-in ``RewardFn`` has, but called once per group.

    Raises:
        RewardImportError: the function does not load (``load_function``).
        ValueError: a param named like a keyword gyre passes.
    """

    def __init__(self, config: RewardConfig) -> None:
        spec = config.function
        self.fn, source = load_function(spec)
        self.name, self.params, self.timeout_s = config.label, dict(config.params), config.timeout_s
        self.spec, self.fn_name = spec, split_spec(spec)[1]
        clash = sorted(set(self.params) & set(RESERVED))
        if clash:
            raise ValueError(f"reward function {spec!r}: params {clash} clash with the keywords gyre passes "
                             f"({', '.join(RESERVED)})")
        blob = json.dumps({"fn": split_spec(spec)[1], "params": self.params}, sort_keys=True,
                          separators=(",", ":"), default=str)
        digest = hashlib.sha256(source + b"\0" + blob.encode()).hexdigest()[:12]
        self.version = f"fn:{self.name}:{digest}"
        self.is_async = is_async(self.fn)

    def kwargs(self, group: Group) -> dict:
        """Keyword arguments of one call, ``completions`` included (see the module docstring)."""
        n = len(group.completions)
        columns = {k: [v] * n for k, v in group.entry.items() if k not in RESERVED}
        completions = ([[{"role": "assistant", "content": c}] for c in group.completions]
                       if is_conversational(group.entry) else list(group.completions))
        return {**columns, "completions": completions, "prompts": list(group.prompts),
                "completion_ids": [list(i) for i in group.completion_ids], **self.params}

    def check_entry(self, entry: dict) -> None:
        """Raise ``KeyError`` if a call with ``entry``'s columns cannot bind to the function's signature."""
        clash = sorted(set(self.params) & set(entry))
        if clash:
            raise KeyError(f"params {clash} clash with entry columns {sorted(entry)}")
        try:
            sig = inspect.signature(self.fn)
        except ValueError:
            return
        try:
            sig.bind(**self.kwargs(Group(["completion"], [[]], entry, [[]])))
        except TypeError as exc:
            raise KeyError(f"reward function {self.spec!r}: {self.fn_name}{sig} cannot take the keywords prompts, completion_ids and the entry's "
                           f"columns {sorted(k for k in entry if k not in RESERVED)}: {exc} (add **kwargs)") from None

    async def score_groups(self, groups: list[Group]) -> list[list[RewardResult]]:
        """One call per group, concurrently; never raises for the function's failure. A sync function's
        budget is ``timeout_s × ceil(len(groups) / POOL_THREADS)`` (queueing in the pool), an async one's
        ``timeout_s``."""
        loop = asyncio.get_running_loop()
        budget = self.timeout_s * (1 if self.is_async else math.ceil(len(groups) / POOL_THREADS))

        async def one(group: Group) -> list[RewardResult]:
            n = len(group.completions)
            kwargs = self.kwargs(group)
            if self.is_async:
                future = asyncio.run_coroutine_threadsafe(_awaited(self.fn(**kwargs)), _async_loop())
                waiting = asyncio.wrap_future(future)
            else:
                waiting = loop.run_in_executor(scoring_pool(), self._call_sync, kwargs)
            done, _ = await asyncio.wait({waiting}, timeout=budget)
            if not done:  # an async call is cancelled; a sync one's thread cannot be and runs on
                waiting.cancel()
                return [RewardResult(0.0, self.version, f"timeout: not scored within {budget:.1f} s")] * n
            if waiting.exception() is not None:  # recovery path: a bad reward costs its group, not the worker
                exc = waiting.exception()
                return [RewardResult(0.0, self.version, f"raised: {type(exc).__name__}: {exc}"[:500])] * n
            return check_scores(waiting.result(), n, self.version)

        return list(await asyncio.gather(*(one(g) for g in groups)))

    def _call_sync(self, kwargs: dict) -> Any:
        out = self.fn(**kwargs)
        if inspect.isawaitable(out):  # a sync callable that returned a coroutine
            out = asyncio.run_coroutine_threadsafe(_awaited(out), _async_loop()).result()
        return out
