"""Samples-per-insert rate limiter: Reverb semantics, liveness in every state, and after restore."""

import itertools
import random
import threading
import time

import pytest
from pydantic import ValidationError

from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import RateLimiterConfig, ReplayConfig
from gyre.replay.rate_limiter import RateLimitedError, RateLimiter
from tests.fakes import group_table


def test_min_size_to_sample_gates_samples_not_inserts():
    buf = TrajectoryBuffer(ReplayConfig(rate_limiter={"min_size_to_sample": 3}))
    buf.insert(group_table(0))
    buf.insert(group_table(1))
    assert buf.sample(1, 0) is None
    buf.insert(group_table(2))
    assert buf.sample(1, 0) is not None


def test_ratio_blocks_the_side_that_runs_ahead():
    rl = RateLimiter(RateLimiterConfig(samples_per_insert=2.0, error_buffer=2.0, min_size_to_sample=1))
    # window: diff = 2*inserted - sampled in [0, 4]
    assert rl.can_insert(size=0, eligible=0, waiting_k=0)  # below min size: always
    rl.on_insert(1)  # diff 2
    assert rl.can_insert(1, 1, 0)  # 2 + 2 <= 4
    rl.on_insert(1)  # diff 4
    assert not rl.can_insert(2, 2, 0)
    assert rl.can_sample(1, 2, 2)
    rl.on_sample(3)  # diff 1
    assert rl.can_sample(1, 2, 2) and rl.can_insert(2, 2, 0)
    rl.on_sample(1)  # diff 0
    assert not rl.can_sample(1, 2, 2)


def test_error_buffer_smaller_than_samples_per_insert_is_refused():
    with pytest.raises(ValidationError, match=r"error_buffer \(1.0\) must be >= max\(1, samples_per_insert\) = 4.0"):
        RateLimiterConfig(samples_per_insert=4.0, error_buffer=1.0)


@pytest.mark.parametrize("spi, err, min_size", [(0.5, 1.0, 1), (1.0, 1.0, 2), (4.0, 4.0, 3), (8.0, 20.0, 1)])
def test_no_state_blocks_both_sides(spi, err, min_size):
    """Liveness: whenever a sampler of k groups and an inserter both wait, one of them may proceed."""
    rl = RateLimiter(RateLimiterConfig(samples_per_insert=spi, error_buffer=err, min_size_to_sample=min_size))
    for inserted, sampled, eligible, leased, k in itertools.product(range(12), range(0, 60, 3), range(6), range(3),
                                                                  (1, 2, 5)):
        rl.inserted, rl.sampled = inserted, sampled
        size = eligible + leased
        assert rl.can_sample(k, size, eligible) or rl.can_insert(size, eligible, waiting_k=k), \
            (inserted, sampled, eligible, leased, k)


def test_buffer_insert_waits_then_times_out_with_a_reason():
    cfg = ReplayConfig(rate_limiter={"samples_per_insert": 1.0, "error_buffer": 1.0, "min_size_to_sample": 1})
    buf = TrajectoryBuffer(cfg)
    buf.insert(group_table(0))  # fills to min size
    buf.insert(group_table(1))  # diff 2 = max_diff
    with pytest.raises(RateLimitedError, match="waiting for samples"):
        buf.insert(group_table(2), timeout_s=0.05)
    assert buf.info()["stored_groups"] == 2
    threading.Timer(0.1, lambda: buf.sample(1, 0)).start()
    assert buf.insert(group_table(2), timeout_s=5).accepted == 4  # unblocked by the sample


def test_inserts_pass_when_the_pool_cannot_serve_a_waiting_sampler():
    """A sampler wants 3 groups, 2 are pooled and the ratio blocks inserts: the insert must pass."""
    cfg = ReplayConfig(rate_limiter={"samples_per_insert": 1.0, "error_buffer": 1.0})
    buf = TrajectoryBuffer(cfg)
    buf.insert(group_table(0))
    buf.insert(group_table(1))
    got = []
    sampler = threading.Thread(target=lambda: got.append(buf.sample(3, 0, timeout_s=10)))
    sampler.start()
    time.sleep(0.1)
    buf.insert(group_table(2), timeout_s=5)
    sampler.join()
    assert got[0] is not None and got[0][1].num_rows == 12


def run_pair(buf, seconds=1.5):
    """A sampler thread and an inserter thread; returns how many of each completed."""
    done = {"sampled": 0, "inserted": 0}
    stop = time.monotonic() + seconds
    next_prompt = iter(range(10_000, 20_000))

    def sample():
        while time.monotonic() < stop:
            got = buf.sample(2, 0, timeout_s=0.2)
            if got:
                buf.ack([got[0]])
                done["sampled"] += 1

    def insert():
        while time.monotonic() < stop:
            try:
                buf.insert(group_table(next(next_prompt)), timeout_s=0.2)
                done["inserted"] += 1
            except RateLimitedError:
                pass

    threads = [threading.Thread(target=sample), threading.Thread(target=insert)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done


@pytest.mark.parametrize("new_spi", [2.0, 0.25])
def test_restored_limiter_state_never_deadlocks(tmp_path, new_spi):
    """Reverb #64/#118: after restore, sampling hung. Here a restored limiter — even with a changed
    samples_per_insert, with leases outstanding and inserts far ahead — keeps both sides moving."""
    limiter = {"samples_per_insert": 1.0, "error_buffer": 2.0, "min_size_to_sample": 2}
    cfg = ReplayConfig(dir=str(tmp_path), rate_limiter=limiter, snapshot={"interval_s": None, "wal_bytes": None})
    buf = TrajectoryBuffer(cfg)
    for i in range(4):
        buf.insert(group_table(i))
    lease, _ = buf.sample(2, 0)
    buf.snapshot()
    buf.insert(group_table(4))
    before = buf.state.limiter.state_dict()
    buf.close()

    same = TrajectoryBuffer(cfg)
    assert same.state.limiter.state_dict() == before and lease in same.state.leases
    same.close()
    changed = cfg.model_copy(update={"rate_limiter": RateLimiterConfig(samples_per_insert=new_spi, error_buffer=2.0,
                                                                       min_size_to_sample=2)})
    buf = TrajectoryBuffer(changed)
    rl = buf.state.limiter
    assert rl._min_diff <= rl.diff <= rl._max_diff  # re-based into the new window
    done = run_pair(buf)
    assert done["sampled"] > 3 and done["inserted"] > 3, done
    buf.close()


def test_random_histories_restore_to_a_live_limiter(tmp_path):
    rng = random.Random(7)
    cfg = ReplayConfig(dir=str(tmp_path), rate_limiter={"samples_per_insert": 2.0, "error_buffer": 3.0},
                       snapshot={"interval_s": None, "wal_bytes": None})
    prompt = 0
    for round_ in range(4):
        buf = TrajectoryBuffer(cfg)
        for _ in range(rng.randrange(3, 12)):
            if rng.random() < 0.5:
                try:
                    buf.insert(group_table(prompt), timeout_s=0)
                    prompt += 1
                except RateLimitedError:
                    pass
            elif (got := buf.sample(1, 0)) is not None and rng.random() < 0.7:
                buf.ack([got[0]])
            if rng.random() < 0.2:
                buf.snapshot()
        buf.close()
        buf = TrajectoryBuffer(cfg)
        s = buf.state
        assert s.can_sample(1) or s.can_insert(1), (round_, s.limiter.info(), buf.info()["size_groups"])
        buf.close()
