"""``bench.learner``'s parts: the classification of learner steps as "during an async save" (only steps begun
while the save was in flight count, so a save that finished first does not pass off an idle step as one), and the
GPU-shaped bench's lengths, baseline micro-batches and model shape (``bench.learner_shapes``)."""

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


def test_grpo_math_lengths_are_seeded_grouped_and_heavy_tailed():
    from bench.learner_shapes import sample_lengths

    rows = sample_lengths("grpo-math")
    assert rows == sample_lengths("grpo-math") and len(rows) == 128
    assert all(64 <= p <= 320 and 32 <= r <= 1536 for p, r in rows)
    assert all(len({p for p, _ in rows[g * 8:(g + 1) * 8]}) == 1 for g in range(16))  # a group shares its prompt
    responses = sorted(r for _, r in rows)
    assert responses[-1] >= 4 * responses[64]  # the tail: the longest answer is several times the median


def test_the_baseline_pads_each_sorted_micro_batch_within_the_budget():
    import torch

    from bench.learner_shapes import sorted_budget_micro_batches

    lengths = torch.tensor([5, 300, 40, 290, 100, 35])
    batches = sorted_budget_micro_batches(lengths, 600)
    assert batches == [[1, 3], [4, 2, 5, 0]]
    assert all(len(b) * int(lengths[b].max()) <= 600 for b in batches)


def test_qwen25_15b_shape_has_its_parameter_count():
    from bench.learner_shapes import parameter_count

    assert parameter_count("qwen2.5-1.5b") == 1_543_714_304
