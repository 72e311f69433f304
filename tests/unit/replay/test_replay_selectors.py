"""Every selector on its own, then through the buffer (config.selector / eviction / priorities)."""

import random
from collections import Counter

import pytest

from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.replay.selectors import FifoSelector, PrioritizedSelector, RecencySelector, UniformSelector, make_selector
from tests.fakes import FakeClock, group_table


def filled(selector, keys, priorities=None):
    for i, k in enumerate(keys):
        selector.add(k, priorities[i] if priorities else 1.0)
    return selector


def test_fifo_picks_oldest_and_a_returned_key_goes_back_to_its_place():
    s = filled(FifoSelector(), [5, 1, 9, 3])
    assert s.pick(3) == [1, 3, 5]
    s.remove(1)
    s.remove(3)
    assert s.pick(2) == [5, 9]
    s.add(3)
    assert s.pick(4 - 1) == [3, 5, 9] and len(s) == 3


def test_recency_picks_newest_first():
    s = filled(RecencySelector(), range(10))
    assert s.pick(3) == [9, 8, 7]
    s.remove(9)
    assert s.pick(1) == [8]


def test_fifo_heap_compacts_after_many_removals():
    s = filled(FifoSelector(), range(1000))
    for k in range(990):
        s.remove(k)
    assert s.pick(10) == list(range(990, 1000)) and len(s._heap) < 200


def test_uniform_picks_distinct_keys_uniformly():
    s = filled(UniformSelector(random.Random(0)), range(10))
    s.remove(3)
    counts = Counter()
    for _ in range(3000):
        got = s.pick(3)
        assert len(set(got)) == 3 and 3 not in got
        counts.update(got)
    assert set(counts) == set(range(10)) - {3}
    assert max(counts.values()) / min(counts.values()) < 1.3  # 9000 draws over 9 keys


def test_prioritized_follows_priorities_and_updates():
    s = filled(PrioritizedSelector(random.Random(0)), [0, 1, 2], [1.0, 2.0, 7.0])
    first = Counter(s.pick(1)[0] for _ in range(5000))
    assert abs(first[2] / 5000 - 0.7) < 0.03 and abs(first[0] / 5000 - 0.1) < 0.02
    s.update(2, 0.0)
    assert all(s.pick(1) != [2] for _ in range(200))
    assert sorted(s.pick(3)) == [0, 1, 2]  # without replacement; zero-priority keys come last


def test_prioritized_exponent_and_growth_beyond_initial_capacity():
    s = filled(PrioritizedSelector(random.Random(1), exponent=0.0), range(3000), [float(i + 1) for i in range(3000)])
    counts = Counter(k for _ in range(300) for k in s.pick(10))
    assert max(counts.values()) < 10  # exponent 0: every key equally likely
    for k in range(0, 3000, 2):
        s.remove(k)
    assert len(s) == 1500 and all(k % 2 for k in s.pick(1500))


@pytest.mark.parametrize("name", ["fifo", "uniform", "prioritized", "recency"])
def test_every_selector_refuses_bad_use(name):
    s = make_selector(name, random.Random(0))
    s.add(1)
    with pytest.raises(KeyError):
        s.add(1)
    with pytest.raises(ValueError, match="cannot pick 2 groups from a pool of 1"):
        s.pick(2)
    s.remove(1)
    with pytest.raises(KeyError):
        s.remove(1)
    with pytest.raises(ValueError, match="unknown selector"):
        make_selector("lifo", random.Random(0))


def prompts(table):
    return list(dict.fromkeys(table.column("prompt_index").to_pylist()))


def buffer(**kw):
    return TrajectoryBuffer(ReplayConfig(seed=0, **kw), clock=FakeClock())


def test_buffer_recency_and_uniform_selectors():
    buf = buffer(selector="recency")
    for i in range(5):
        buf.insert(group_table(i))
    assert prompts(buf.sample(2, 0)[1]) == [4, 3]
    buf = buffer(selector="uniform")
    for i in range(50):
        buf.insert(group_table(i))
    assert prompts(buf.sample(5, 0)[1]) != [0, 1, 2, 3, 4]


def test_buffer_prioritized_with_priority_updates():
    buf = buffer(selector="prioritized", max_times_sampled=1000)
    for i in range(4):
        buf.insert(group_table(i))
    updated, unknown = buf.update_priorities(["0-0", "1-0", "2-0", "9-0"], [0.0, 0.0, 5.0, 1.0])
    assert (updated, unknown) == (3, ["9-0"])
    for _ in range(20):
        lease, table = buf.sample(1, 0)
        assert prompts(table) in ([2], [3])
        buf.release([lease])
    with pytest.raises(ValueError, match="priority nan for group '3-0'"):
        buf.update_priorities(["3-0"], [float("nan")])


@pytest.mark.parametrize("eviction, survivors", [("fifo", [2, 3, 4]), ("recency", [0, 1, 4])])
def test_capacity_eviction_selector(eviction, survivors):
    buf = buffer(capacity_groups=3, eviction=eviction)
    for i in range(5):
        buf.insert(group_table(i))
    assert sorted(prompts(buf.sample(3, 0)[1])) == survivors
    assert buf.info()["evicted_groups_total"] == 2


def test_eviction_never_takes_leased_groups_and_takes_excluded_first():
    buf = buffer(capacity_groups=2, staleness_mode="exclude", max_staleness=0)
    buf.insert(group_table(0, version=0))
    lease, _ = buf.sample(1, 0)
    buf.insert(group_table(1, version=0))
    assert buf.sample(1, 1) is None  # learner moved to 1: group 1 becomes excluded
    assert buf.info()["excluded_groups"] == 1
    buf.insert(group_table(2, version=1))  # over capacity: the excluded group goes, not the leased one
    info = buf.info()
    assert (info["leased_groups"], info["excluded_groups"], info["size_groups"]) == (1, 0, 1)
    assert buf.ack([lease]) == 1
