"""Threads for the blocking methods of multi-turn environments, and a bound on the calls left running.

A plain (not ``async def``) ``reset``/``step``/``close`` of a user ``rollout.environment.Environment`` runs in a
thread, so a blocking tool call does not stall generation. Python cannot stop a thread: when an episode's time
budget runs out during such a call, the episode ends at once (broken, ``"episode-time_budget: ..."``) and the call's
thread is *abandoned*: it runs on until the call returns by itself, its result dropped. ``EnvThreads``

- runs each call in a daemon thread of its own, never in the event loop's default executor (replay and spool I/O
  run there: abandoned calls cannot starve them, and one never holds up the process's exit);
- counts the abandoned calls still running (``stuck``) and in total (``abandoned``);
- refuses new episodes (``admit``) and their ``reset``/``step`` calls (``EnvCallsStuckError``, counted in
  ``refused``) while ``stuck`` is at ``max_stuck``: each stuck call holds a thread and whatever the environment holds
  (sockets, processes, memory), and an environment that hangs once usually hangs every episode. ``close`` is never
  refused (it may be what frees a stuck call: a sandbox killed, a socket closed) and runs at most once per admitted
  episode, so ``stuck`` stays below ``max_stuck`` plus two calls per episode in flight. Calls are taken again as soon
  as stuck ones return.

Only restarting the process ends a call that never returns; a rollout whose ``stuck`` stays at its bound (its
episodes all broken with ``"episode-env_stuck: ..."``) needs one. ``async def`` methods are cancelled at the budget
like any coroutine and never count here.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import Any, Callable

import structlog

log = structlog.get_logger("rollout.env_threads")


class EnvCallsStuckError(RuntimeError):
    """A call was refused: ``max_stuck`` abandoned calls are still running; the message names the count and limit."""


class EnvThreads:
    """Runs blocking environment methods in threads, bounding the ones abandoned past their episode's budget.

    Args:
        max_stuck: most abandoned calls still running before new calls are refused (``>= 1``).

    Raises:
        ValueError: ``max_stuck`` is not a positive integer.
    """

    def __init__(self, max_stuck: int) -> None:
        if not isinstance(max_stuck, int) or isinstance(max_stuck, bool) or max_stuck < 1:
            raise ValueError(f"max_stuck ({max_stuck!r}) must be a positive integer")
        self.max_stuck = max_stuck
        self.stuck = 0
        """Abandoned calls whose thread still runs (their caller was cancelled: the time budget ran out)."""
        self.abandoned = 0
        """Calls abandoned so far (the ones that returned since included)."""
        self.refused = 0
        """Calls refused so far because ``stuck`` was at ``max_stuck``."""
        self._lock = threading.Lock()  # the counters: the event loop and the call threads both change them
        self._refusing = False  # refused since a stuck call last returned (logs the first refusal of a spell)

    def admit(self, what: str) -> None:
        """Check that ``what`` (a new episode, a call) may start: count and raise when ``stuck`` is at ``max_stuck``.

        Raises:
            EnvCallsStuckError: it may not; the message names ``what``, the count and the limit.
        """
        with self._lock:
            refuse = self.stuck >= self.max_stuck
            if refuse:
                self.refused += 1
                stuck, first, self._refusing = self.stuck, not self._refusing, True
        if refuse:
            if first:  # once per spell of refusals
                log.error("environment_calls_refused", stuck=stuck, max_stuck=self.max_stuck, refused=what)
            raise EnvCallsStuckError(
                f"{stuck} environment calls are still running past their episode's time budget (limit "
                f"{self.max_stuck}, rollout.environment.max_stuck_calls); refusing {what} until one returns "
                "(only a restart of the rollout ends a call that never does)")

    async def call(self, fn: Callable[..., Any], *args: Any, refusable: bool = True) -> Any:
        """``fn(*args)`` in a daemon thread of its own (with the caller's context variables); its result, or what it
        raised. Cancelling the caller returns at once: a call still running is then abandoned (counted, logged).
        ``refusable``: whether ``admit`` checks it first (``close`` is not).

        Raises:
            EnvCallsStuckError: ``refusable`` and ``stuck`` is at ``max_stuck`` (``fn`` is not called).
            asyncio.CancelledError: the caller was cancelled.
        """
        if refusable:
            self.admit(_name(fn))
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        state = {"done": False, "abandoned": False}
        context = contextvars.copy_context()

        def settle(result: Any, error: BaseException | None) -> None:
            if future.done():  # the caller was cancelled meanwhile
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def target() -> None:
            result, error = None, None
            try:
                result = context.run(fn, *args)
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller as is
                error = exc
            with self._lock:
                state["done"] = True
                if state["abandoned"]:
                    self.stuck -= 1
                    self._refusing = False
            if state["abandoned"]:
                log.info("environment_call_returned_late", call=_name(fn), stuck=self.stuck)
                return
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the event loop closed meanwhile: nobody waits for the result
                pass

        threading.Thread(target=target, name=f"env-{_name(fn)}", daemon=True).start()
        try:
            return await future
        except asyncio.CancelledError:
            with self._lock:
                if not state["done"]:
                    state["abandoned"] = True
                    self.stuck += 1
                    self.abandoned += 1
            if state["abandoned"]:
                log.warning("environment_call_abandoned", call=_name(fn), stuck=self.stuck, max_stuck=self.max_stuck)
            raise

    def as_dict(self) -> dict[str, int]:
        """``env_calls_stuck`` (now), ``env_calls_abandoned`` and ``env_calls_refused`` (totals)."""
        return {"env_calls_stuck": self.stuck, "env_calls_abandoned": self.abandoned,
                "env_calls_refused": self.refused}


def _name(fn: Callable[..., Any]) -> str:
    """``Class.method`` of a bound method (the object's class), else the function's name, for logs and messages."""
    name = getattr(fn, "__name__", None) or repr(fn)
    owner = getattr(fn, "__self__", None)
    return f"{type(owner).__name__}.{name}" if owner is not None else name
