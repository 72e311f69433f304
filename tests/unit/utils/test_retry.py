"""``utils.retry``: the doubling backoff and the reconnect loop of the weight subscriber and the NCCL transport."""

import threading
import time
from types import SimpleNamespace

import pytest

from gyre.utils.retry import doubling, reconnect_forever


def test_doubling_waits_first_then_twice_the_previous_up_to_the_cap():
    waits = [doubling(0.5, 10.0)(SimpleNamespace(attempt_number=n)) for n in range(1, 8)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert [doubling(50.0, 30.0)(SimpleNamespace(attempt_number=n)) for n in (1, 2, 3)] == [50.0, 30.0, 30.0]


def test_reconnect_backs_off_per_error_starts_over_after_a_clean_return_and_raises_other_errors():
    stop, retries = threading.Event(), []
    script = [ConnectionError] * 4 + [None, TimeoutError, KeyError]

    def connect():
        outcome = script.pop(0)
        if outcome is not None:
            raise outcome("scripted")

    with pytest.raises(KeyError):  # not a retry_on type: raised at once, not handed to on_retry
        reconnect_forever(connect, stop, (ConnectionError, TimeoutError), 0.01, 0.04,
                          lambda exc, wait_s: retries.append((type(exc), wait_s)))
    assert retries == [(ConnectionError, 0.01), (ConnectionError, 0.02), (ConnectionError, 0.04),
                       (ConnectionError, 0.04), (TimeoutError, 0.01)] and script == []


def test_reconnect_stop_ends_a_backoff_wait_at_once_and_an_error_after_stop_is_dropped():
    stop, retries, calls = threading.Event(), [], []

    def connect():
        calls.append(time.monotonic())
        if len(calls) == 2:
            stop.set()  # e.g. stop() cancelled the stream: its error is no failure
        raise ConnectionError("learner down")

    thread = threading.Thread(target=reconnect_forever, args=(
        connect, stop, (ConnectionError,), 0.01, 60.0, lambda exc, wait_s: retries.append(wait_s)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while len(calls) < 2:
        assert time.monotonic() < deadline, "timed out waiting for the second connect"
        time.sleep(0.01)
    thread.join(timeout=30)
    assert not thread.is_alive() and retries == [0.01], "the error raised after stop was set was handed on"

    stop, retries = threading.Event(), []
    thread = threading.Thread(target=reconnect_forever, args=(
        lambda: (_ for _ in ()).throw(ConnectionError("learner down")), stop, (ConnectionError,), 60.0, 60.0,
        lambda exc, wait_s: retries.append(wait_s)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not retries:
        assert time.monotonic() < deadline, "timed out waiting for the first failure"
        time.sleep(0.01)
    stop.set()
    thread.join(timeout=10)  # far below the 60 s wait it is in
    assert not thread.is_alive(), "stop did not end the 60 s backoff wait"
    assert retries == [60.0]
