import pyarrow as pa
import pytest

from gyre.replay.buffer import TrajectoryBuffer, UnknownLeaseError
from gyre.replay.config import ReplayConfig
from gyre.replay.ledger import PromptLedger
from tests.fakes import FakeClock, group_table


def make_buffer(**kw):
    clock = FakeClock()
    return TrajectoryBuffer(ReplayConfig(**kw), clock=clock), clock


def test_fifo_sampling_keeps_groups_whole():
    buf, _ = make_buffer()
    buf.insert(pa.concat_tables([group_table(0), group_table(1)]))
    buf.insert(group_table(2))
    lease_id, table = buf.sample(2, learner_version=0)
    assert table.column("group_id").to_pylist() == ["0-0"] * 4 + ["1-0"] * 4
    _, table = buf.sample(1, learner_version=0)
    assert set(table.column("group_id").to_pylist()) == {"2-0"}
    assert buf.sample(1, learner_version=0) is None


def test_duplicate_trajectories_are_acknowledged_not_stored():
    buf, _ = make_buffer()
    assert buf.insert(group_table(0)).accepted == 4
    again = buf.insert(group_table(0))
    assert (again.accepted, again.duplicates) == (0, 4)
    assert buf.info()["size_trajectories"] == 4


def test_second_attempt_of_completed_prompt_is_dropped():
    buf, _ = make_buffer()
    buf.insert(group_table(3, attempt=0))
    assert buf.insert(group_table(3, attempt=1)).duplicates == 4
    assert buf.info()["prompts_completed"] == 1


def test_staleness_gate_drops_old_groups_at_sample_and_insert():
    buf, _ = make_buffer(max_staleness=1)
    buf.insert(group_table(0, version=0))
    buf.insert(group_table(1, version=2))
    _, table = buf.sample(1, learner_version=2)  # group 0 has lag 2 > 1: dropped
    assert set(table.column("prompt_index").to_pylist()) == {1}
    assert buf.info()["dropped_stale_total"] == 4
    assert buf.insert(group_table(2, version=0)).dropped_stale == 4


def test_staleness_uses_oldest_span():
    buf, _ = make_buffer(max_staleness=1)
    buf.insert(group_table(0, spans=([0, 2], [0, 2])))
    assert buf.sample(1, learner_version=2) is None


def test_release_returns_groups_to_front_and_ack_consumes():
    buf, _ = make_buffer()
    for i in range(3):
        buf.insert(group_table(i))
    lease, _ = buf.sample(2, 0)
    assert buf.release([lease]) == 2
    lease, table = buf.sample(1, 0)
    assert set(table.column("prompt_index").to_pylist()) == {0}
    assert buf.ack([lease]) == 1
    assert buf.info()["acked_groups_total"] == 1
    assert buf.ack([lease]) == 0  # a repeated ack (a retry after a lost answer) is idempotent
    with pytest.raises(UnknownLeaseError, match=repr(lease)):
        buf.release([lease])


def test_expired_sample_lease_returns_by_itself():
    buf, clock = make_buffer(lease_ttl_s=5)
    buf.insert(group_table(0))
    lease, _ = buf.sample(1, 0)
    assert buf.sample(1, 0) is None
    clock.advance(6)
    assert buf.sample(1, 0) is not None
    with pytest.raises(UnknownLeaseError):
        buf.ack([lease])


def test_capacity_evicts_oldest_ready_group():
    buf, _ = make_buffer(capacity_groups=2)
    for i in range(3):
        buf.insert(group_table(i))
    _, table = buf.sample(2, 0)
    assert sorted(set(table.column("prompt_index").to_pylist())) == [1, 2]


def test_ledger_reissues_expired_prompts_with_next_attempt():
    clock = FakeClock()
    ledger = PromptLedger(num_prompts=3, clock=clock)
    assert ledger.lease("a", 2, ttl_s=10) == [(0, 0), (1, 0)]
    assert ledger.complete(0)
    clock.advance(11)
    assert ledger.lease("b", 5, ttl_s=10) == [(1, 1), (2, 0)]
    assert not ledger.complete(0)
    assert ledger.lease("c", 1, ttl_s=10) == []


def test_insert_completes_prompt_in_ledger():
    buf, _ = make_buffer(num_prompts=2)
    assert buf.lease_prompts("r", 2, ttl_s=5) == [(0, 0), (1, 0)]
    buf.insert(group_table(0))
    assert buf.info()["prompts_completed"] == 1


def test_an_empty_insert_stores_nothing_and_replays(tmp_path):
    cfg = dict(dir=str(tmp_path), snapshot={"interval_s": None, "wal_bytes": None})
    buf = TrajectoryBuffer(ReplayConfig(**cfg))
    assert buf.insert(group_table(0).slice(0, 0)).accepted == 0
    assert buf.insert(group_table(1)).accepted == 4
    buf.close()
    restored = TrajectoryBuffer(ReplayConfig(**cfg))
    assert restored.info()["restore_records_replayed"] == 2
    assert [g.group_id for g in restored.state.store.groups.values()] == ["1-0"]
    restored.close()


def test_an_insert_stores_one_table_and_groups_point_into_it():
    buf, _ = make_buffer()
    table = pa.concat_tables([group_table(0), group_table(1), group_table(2)])
    buf.insert(table)
    groups = list(buf.state.store.groups.values())
    assert len({id(g.source) for g in groups}) == 1  # no per-group table
    assert [(g.group_id, g.offset, g.num_rows) for g in groups] == [("0-0", 0, 4), ("1-0", 4, 4), ("2-0", 8, 4)]
    assert groups[1].table.equals(table.slice(4, 4))
