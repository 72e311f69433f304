"""Retry policies shared by gyre's reconnect and re-send loops, on tenacity.

``doubling`` is the one backoff of the loops that wait longer after each failure (the rollout's replay insert,
the weight subscriber's stream, the NCCL transport's announce stream); ``reconnect_forever`` is the whole
reconnect loop of a background thread that follows a stream until its stop event is set. Imports neither grpc
nor ray, so the cores (``rollout/``, ``learner/``, ``replay/``) may use it too.
"""

from __future__ import annotations

import threading
from typing import Callable

from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_when_event_set, wait_exponential
from tenacity.nap import sleep_using_event


class doubling(wait_exponential):
    """tenacity wait: ``first_s`` seconds after the first failure, then twice the previous wait, at most
    ``cap_s``: ``first_s, min(2 first_s, cap_s), min(4 first_s, cap_s), ...`` (a ``first_s`` above ``cap_s`` is
    waited once, then ``cap_s``). No jitter."""

    def __init__(self, first_s: float, cap_s: float) -> None:
        super().__init__(multiplier=first_s, max=cap_s)

    def __call__(self, retry_state: RetryCallState) -> float:
        if retry_state.attempt_number == 1:
            return float(self.multiplier)
        return super().__call__(retry_state)


def reconnect_forever(connect: Callable[[], object], stop: threading.Event,
                      retry_on: tuple[type[BaseException], ...], first_s: float, cap_s: float,
                      on_retry: Callable[[BaseException, float], None]) -> None:
    """Call ``connect()`` again and again until ``stop`` is set; returns then.

    A clean return reconnects at once (the backoff starts again at ``first_s``). An error of a ``retry_on``
    type is handed to ``on_retry(error, wait_s)`` (count it, log it), then waited out ``doubling(first_s,
    cap_s)`` seconds; setting ``stop`` ends the wait at once, and an error raised after ``stop`` was set is
    dropped silently (``on_retry`` is not called). Any other error is raised.
    """
    def before_sleep(state: RetryCallState) -> None:
        on_retry(state.outcome.exception(), state.upcoming_sleep)

    retrying = Retrying(retry=retry_if_exception_type(retry_on), wait=doubling(first_s, cap_s),
                        stop=stop_when_event_set(stop), sleep=sleep_using_event(stop), before_sleep=before_sleep,
                        retry_error_callback=lambda state: None)
    while not stop.is_set():
        retrying(connect)
