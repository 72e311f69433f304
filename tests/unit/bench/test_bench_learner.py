"""``bench.learner``'s classification of learner steps as "during an async save": only steps begun while
the save was in flight count, so a save that finished first does not pass off an idle step as one."""

from collections.abc import Callable
from concurrent.futures import Future

from bench.learner import steps_while_pending


def stepping(future: Future, finish_in_step: int | None) -> tuple[list[int], Callable[[], None]]:
    """A step that records its calls and completes ``future`` inside call number ``finish_in_step``."""
    calls: list[int] = []

    def step() -> None:
        calls.append(len(calls) + 1)
        if len(calls) == finish_in_step:
            future.set_result("global_step_1")

    return calls, step


def test_a_save_done_before_any_step_has_no_steps_during_it():
    future = Future()
    future.set_result("global_step_1")
    calls, step = stepping(future, None)
    assert steps_while_pending(step, future) == [] and calls == []


def test_every_step_begun_while_the_save_was_in_flight_counts_and_none_after():
    future = Future()
    calls, step = stepping(future, finish_in_step=3)  # the save finishes during the 3rd step
    during = steps_while_pending(step, future)
    assert calls == [1, 2, 3] and len(during) == 3 and all(s >= 0 for s in during)
    assert steps_while_pending(step, future) == [] and calls == [1, 2, 3]  # the next step is not "during"
