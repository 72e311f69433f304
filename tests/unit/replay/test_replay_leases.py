"""Sample leases (ack, release, expiry, reuse), the staleness modes and the prompt ledger."""

import pyarrow as pa
import pytest

from gyre.proto.trajectory import SchemaError
from gyre.replay.buffer import TrajectoryBuffer, UnknownLeaseError
from gyre.replay.config import ReplayConfig
from gyre.replay.ledger import PromptLedger
from tests.fakes import FakeClock, group_table, make_group


def make_buffer(**kw):
    clock = FakeClock()
    return TrajectoryBuffer(ReplayConfig(**kw), clock=clock), clock


def test_bad_lease_ids_change_nothing():
    buf, _ = make_buffer()
    buf.insert(group_table(0))
    lease, _ = buf.sample(1, 0)
    with pytest.raises(UnknownLeaseError, match="'nope'"):
        buf.ack([lease, "nope"])
    assert lease in buf.state.leases and buf.info()["acked_groups_total"] == 0
    assert buf.ack([lease, lease]) == 1  # a repeated id counts once


def test_max_times_sampled_reuses_acked_groups():
    buf, _ = make_buffer(max_times_sampled=2)
    buf.insert(group_table(0))
    for expected_left in (1, 0):
        lease, _ = buf.sample(1, 0)
        buf.ack([lease])
        assert buf.info()["stored_groups"] == expected_left
    assert buf.info()["consumed_groups_total"] == 1 and buf.info()["acked_groups_total"] == 2


def test_release_and_expiry_do_not_count_as_samples():
    buf, clock = make_buffer(max_times_sampled=1, lease_ttl_s=5)
    buf.insert(group_table(0))
    lease, _ = buf.sample(1, 0)
    buf.release([lease])
    lease, _ = buf.sample(1, 0)
    clock.advance(6)
    lease2, _ = buf.sample(1, 0)  # the expired lease came back untouched
    assert buf.state.store.groups[0].times_sampled == 1
    info = buf.info()
    assert (info["released_groups_total"], info["expired_groups_total"], info["rl_sampled"]) == (1, 1, 1)
    with pytest.raises(UnknownLeaseError):
        buf.release([lease])


def test_exclude_mode_keeps_stale_groups_but_never_hands_them_out():
    buf, _ = make_buffer(max_staleness=1, staleness_mode="exclude")
    buf.insert(group_table(0, version=0))
    buf.insert(group_table(1, version=2))
    _, table = buf.sample(1, learner_version=2)
    assert set(table.column("prompt_index").to_pylist()) == {1}
    info = buf.info()
    assert (info["excluded_groups"], info["stored_groups"], info["dropped_stale_total"]) == (1, 2, 0)
    assert buf.insert(group_table(2, version=0)).dropped_stale == 4
    assert buf.info()["excluded_groups"] == 2 and buf.sample(1, 2) is None


def test_a_released_group_that_became_stale_is_dropped():
    buf, _ = make_buffer(max_staleness=0)
    buf.insert(group_table(0, version=0))
    buf.insert(group_table(1, version=1))
    lease, _ = buf.sample(1, 0)
    buf.sample(1, 1)  # learner moves on while group 0 is leased
    buf.release([lease])
    assert buf.info()["dropped_stale_total"] == 4 and buf.info()["stored_groups"] == 1


def test_staleness_histogram_counts_lag_at_sample():
    buf, _ = make_buffer(max_staleness=3)
    buf.insert(group_table(0, version=0))
    buf.insert(group_table(1, version=2))
    buf.sample(2, learner_version=3)
    assert buf.info()["staleness_at_sample"] == {3: 1, 1: 1}


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.set_column(0, pa.field("trajectory_id", pa.utf8(), nullable=False), pa.array(["x"] * t.num_rows)),
     "trajectory_id 'x' is not"),
    (lambda t: pa.concat_tables([t, t]), "appears more than once"),
])
def test_malformed_ids_are_refused_and_nothing_changes(mutate, message):
    buf, _ = make_buffer()
    with pytest.raises(SchemaError, match=message):
        buf.insert(mutate(group_table(0)))
    assert buf.info()["stored_groups"] == 0 and buf.info()["prompts_completed"] == 0


def test_groups_arrive_whole_even_when_rows_interleave():
    rows = make_group(0) + make_group(1)
    table = pa.Table.from_pylist([r.__dict__ for r in rows[::2] + rows[1::2]], schema=group_table(0).schema)
    buf, _ = make_buffer()
    assert buf.insert(table).accepted == 8
    _, got = buf.sample(1, 0)
    assert got.column("group_id").to_pylist() == ["0-0"] * 4


def test_ledger_state_round_trip_and_watermark():
    clock = FakeClock()
    ledger = PromptLedger(num_prompts=None, clock=clock)
    ledger.lease("a", 5, ttl_s=10)
    for i in (0, 1, 3):
        ledger.complete(i)
    clock.advance(11)
    assert ledger.expire() == [(2, 1), (4, 1)]
    state = ledger.state_dict()
    assert (state["done_below"], state["done_above"]) == (2, [3])
    again = PromptLedger(clock=clock)
    again.load_state_dict(state)
    assert again.lease("b", 3, ttl_s=10) == [(2, 1), (4, 1), (5, 0)]
    assert again.num_completed == 3 and not again.complete(3)


def test_each_prompt_completes_once_across_reissue_and_restart(tmp_path):
    cfg = ReplayConfig(dir=str(tmp_path), num_prompts=4, prompt_lease_ttl_s=5,
                       snapshot={"interval_s": None, "wal_bytes": None})
    clock = FakeClock(1000.0)
    buf = TrajectoryBuffer(cfg, clock=clock)
    assert buf.lease_prompts("r0", 4) == [(0, 0), (1, 0), (2, 0), (3, 0)]
    buf.insert(group_table(0))
    clock.advance(6)
    assert buf.lease_prompts("r1", 2) == [(1, 1), (2, 1)]  # expired, re-issued with attempt + 1
    buf.close()
    buf = TrajectoryBuffer(cfg, clock=clock)  # restart: the same leases and queue
    assert buf.lease_prompts("r2", 4) == [(3, 1)]
    assert buf.insert(group_table(1, attempt=0)).accepted == 4  # the late first attempt wins
    assert buf.insert(group_table(1, attempt=1)).duplicates == 4
    buf.insert(group_table(2, attempt=1))
    buf.insert(group_table(3, attempt=1))
    assert buf.info()["prompts_completed"] == 4 and buf.lease_prompts("r3", 4) == []
    buf.close()


def test_a_retried_sample_gets_its_lease_again_instead_of_a_second_one():
    buf, _ = make_buffer()
    for i in range(3):
        buf.insert(group_table(i))
    lease, table = buf.sample(2, 0, consumer="learner", request_id="r1")
    before = buf.info()
    again, table_again = buf.sample(2, 0, consumer="learner", request_id="r1")  # the answer was lost; retry
    assert again == lease and table_again.equals(table)
    assert buf.info()["active_leases"] == 1 and buf.info()["sampled_groups_total"] == before["sampled_groups_total"]
    other, _ = buf.sample(1, 0, consumer="evaluator", request_id="r1")  # the key is per consumer
    assert other != lease
    assert buf.ack([lease]) == 2
    # once acked, the key names no lease: a new sample with it leases afresh (the last pooled group is leased)
    assert buf.sample(1, 0, consumer="learner", request_id="r1") is None


def test_a_sample_retried_after_its_lease_expired_gets_a_new_lease():
    buf, clock = make_buffer(lease_ttl_s=5)
    for i in range(2):
        buf.insert(group_table(i))
    lease, _ = buf.sample(2, 0, consumer="learner", request_id="r1")
    clock.advance(6)  # the retry comes after the lease's deadline: its groups are due back in the pool
    again, _ = buf.sample(2, 0, consumer="learner", request_id="r1")
    assert again != lease and lease not in buf.state.leases
    assert buf.info()["expired_groups_total"] == 2 and buf.info()["active_leases"] == 1


@pytest.mark.parametrize("kw, match", [({"request_id": "x" * 129}, "request_id is 129 characters"),
                                       ({"request_id": "r1", "num_groups": 1}, "names lease .* of 2 groups")])
def test_a_bad_sample_request_id_is_refused_and_changes_nothing(kw, match):
    buf, _ = make_buffer()
    for i in range(3):
        buf.insert(group_table(i))
    buf.sample(2, 0, consumer="learner", request_id="r1")
    before = buf.info()
    with pytest.raises(ValueError, match=match):
        buf.sample(kw.pop("num_groups", 2), 0, consumer="learner", **kw)
    assert buf.info()["active_leases"] == before["active_leases"] == 1


@pytest.mark.parametrize("snapshot_first", [False, True], ids=["wal", "snapshot"])
def test_a_sample_retried_after_a_replay_restart_gets_the_restored_lease(tmp_path, snapshot_first):
    """The lease record was durable but the answer died with the process: the retry must not leave the
    restored lease holding its groups until ``lease_ttl_s`` (a lockstep learner waits for exactly those)."""
    cfg = ReplayConfig(dir=str(tmp_path), snapshot={"interval_s": None, "wal_bytes": None})
    buf = TrajectoryBuffer(cfg)
    for i in range(2):
        buf.insert(group_table(i))
    lease, table = buf.sample(2, 0, consumer="learner", request_id="step-1")
    if snapshot_first:
        assert buf.snapshot() is not None
    buf.close()
    buf = TrajectoryBuffer(cfg)  # restarted on the same directory
    assert buf.state.leases[lease].request_id == "step-1"
    again, table_again = buf.sample(2, 0, consumer="learner", request_id="step-1", timeout_s=0.1)
    assert again == lease and table_again.equals(table)
    assert buf.ack([lease]) == 2 and buf.info()["stored_groups"] == 0
    buf.close()


def test_the_deadline_heap_finds_exactly_the_overdue_leases_through_leases_expiries_and_completions():
    """``due`` walks a heap of deadlines (not every lease); whatever the history of leases, re-issues, completions and
    restores, it returns what a scan of every lease returns, earliest deadline first."""
    import random

    rng = random.Random(7)
    ledger, now = PromptLedger(clock=lambda: now), 0.0
    for step in range(400):
        now += rng.random()
        op = rng.random()
        if op < 0.5:
            ledger.lease(f"r{rng.randrange(8)}", rng.randrange(1, 5), ttl_s=rng.uniform(0.5, 20.0), now=now)
        elif op < 0.7 and ledger.num_leased:
            ledger.complete(rng.choice(list(ledger._leases)))
        elif op < 0.8:
            ledger.expire(now)
        elif op < 0.85:
            restored = PromptLedger(clock=lambda: now)
            restored.load_state_dict(ledger.state_dict())
            ledger = restored
        at = now + rng.uniform(-5.0, 15.0)
        scan = sorted((lease.expires_at, i, lease.attempt + 1) for i, lease in ledger._leases.items()
                      if lease.expires_at <= at)
        assert ledger.due(at) == [(i, a) for _, i, a in scan], step
    assert len(ledger._deadlines) <= 2 * ledger.num_leased + 64  # stale entries do not pile up
