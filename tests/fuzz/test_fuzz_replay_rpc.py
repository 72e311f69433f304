"""Fuzz every ReplayService RPC against a real durable server on port 0 (hypothesis).

Each malformed input must get a status in ``NAMED_CODES`` whose message names the field or value, the
server must stay healthy and keep accepting valid inserts, and ``Info`` must not change. The cases at
the end of this file (and ``test_fuzz_replay_crash.py``) are inputs this fuzzing found replay accepting
or crashing on (nullable or extra or reordered columns, negative indices); each is refused now.
"""

from __future__ import annotations

import math

import grpc
import pyarrow as pa
import pytest
from hypothesis import given, strategies as st

from gyre.proto import replay_pb2
from gyre.proto.trajectory import SCHEMA_VERSION, to_ipc
from tests.fakes import group_table
from tests.fuzz.bad_trajectories import bad_payloads, raw_ipc
from tests.fuzz.replay_harness import ReplayUnderTest, assert_rejected

UINT32 = st.integers(0, 2**32 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    """One server for the module, holding two pooled groups and one leased group from the start."""
    r = ReplayUnderTest(tmp_path_factory.mktemp("replay-fuzz"))
    for _ in range(3):
        assert r.insert_fresh_group().accepted == 4
    r.lease = r.stub.Sample(replay_pb2.SampleRequest(schema_version=SCHEMA_VERSION, num_groups=1), timeout=10).lease_id
    assert r.lease
    yield r
    r.close()


def test_the_server_accepts_a_valid_insert(replay):
    """The control: without it every rejection below could be a server that rejects everything."""
    assert replay.insert_fresh_group().accepted == 4


# ---- Insert --------------------------------------------------------------------------------------
@given(case=bad_payloads(), batch_id=st.integers(0, 2**64 - 1))
def test_malformed_arrow_is_invalid_argument_naming_the_problem(replay, case, batch_id):
    payload, names = case
    err = assert_rejected(replay, lambda: replay.insert(payload, batch_id=batch_id), names)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(f"batch {batch_id}")
    assert replay.insert_fresh_group().accepted == 4


@given(version=UINT32.filter(lambda v: v != SCHEMA_VERSION))
def test_unknown_request_schema_version_names_both(replay, version):
    payload = to_ipc(group_table(10**6))
    err = assert_rejected(replay, lambda: replay.insert(payload, schema_version=version),
                          f"schema_version {version} is not supported; this server speaks {SCHEMA_VERSION}")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def _without_wal(info: dict) -> dict:
    """Replay's state in ``info``: not the WAL's counters, nor the request latencies (the no-op insert is a request)."""
    return {k: v for k, v in info.items() if not k.startswith("wal_") and "_latency_" not in k}


def test_an_empty_table_is_a_no_op(replay):
    """Documented in tests/unit/replay/test_replay_buffer.py: 0 rows store nothing (the WAL logs the no-op)."""
    before = replay.info()
    resp = replay.insert(raw_ipc(group_table(2 * 10**9).slice(0, 0)))
    assert (resp.accepted, resp.duplicates, resp.dropped_stale) == (0, 0, 0)
    assert _without_wal(replay.info()) == _without_wal(before)


# ---- Sample --------------------------------------------------------------------------------------
BAD_TIMEOUTS = st.one_of(st.floats(max_value=-1e-6), st.floats(min_value=600.001), st.just(math.nan))


@given(version=UINT32.filter(lambda v: v != SCHEMA_VERSION), num_groups=UINT32, learner_version=INT64)
def test_sample_with_unknown_schema_version(replay, version, num_groups, learner_version):
    request = replay_pb2.SampleRequest(schema_version=version, num_groups=num_groups, learner_version=learner_version)
    assert_rejected(replay, lambda: replay.stub.Sample(request, timeout=10), f"schema_version {version}")


@given(learner_version=INT64, consumer=st.text(max_size=20))
def test_sample_of_zero_groups(replay, learner_version, consumer):
    request = replay_pb2.SampleRequest(schema_version=SCHEMA_VERSION, num_groups=0, learner_version=learner_version,
                                       consumer=consumer)
    assert_rejected(replay, lambda: replay.stub.Sample(request, timeout=10), "num_groups (0) must be >= 1")


@given(request_id=st.text(min_size=129, max_size=300), num_groups=st.integers(1, 8))
def test_sample_with_an_overlong_request_id(replay, request_id, num_groups):
    request = replay_pb2.SampleRequest(schema_version=SCHEMA_VERSION, num_groups=num_groups, request_id=request_id)
    assert_rejected(replay, lambda: replay.stub.Sample(request, timeout=10), f"request_id is {len(request_id)} characters")


@given(num_groups=st.integers(1, 2**32 - 1), timeout=BAD_TIMEOUTS, learner_version=INT64)
def test_sample_with_a_bad_timeout(replay, num_groups, timeout, learner_version):
    request = replay_pb2.SampleRequest(schema_version=SCHEMA_VERSION, num_groups=num_groups,
                                       learner_version=learner_version, timeout_s=timeout)
    assert_rejected(replay, lambda: replay.stub.Sample(request, timeout=10), "timeout_s (")


@given(indices=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=6), extra=st.integers(-1, 1))
def test_sample_of_bad_prompt_indices(replay, indices, extra):
    """Lockstep's exact-prompt lease: a count that differs from num_groups, a repeated or a negative index."""
    num_groups = len(indices) + extra
    if extra == 0 and len(set(indices)) == len(indices) and min(indices) >= 0:
        indices = indices + indices[:1]  # make it invalid: a repeat (and one more than num_groups)
    if num_groups < 1:
        num_groups = len(indices) + 1
    request = replay_pb2.SampleRequest(schema_version=SCHEMA_VERSION, num_groups=num_groups, learner_version=0,
                                       prompt_indices=indices)
    assert_rejected(replay, lambda: replay.stub.Sample(request, timeout=10), "distinct indices >= 0")


@given(num_groups=st.integers(4097, 2**32 - 1), learner_version=st.integers(-(2**63), 0))
def test_sample_of_more_groups_than_stored_is_empty_and_changes_nothing(replay, num_groups, learner_version):
    """Counts above the capacity (4096 groups) are not an error: nothing is ready, the answer is empty, nothing is leased."""
    before = replay.info()
    resp = replay.stub.Sample(replay_pb2.SampleRequest(schema_version=SCHEMA_VERSION, num_groups=num_groups,
                                                       learner_version=learner_version), timeout=10)
    assert (resp.lease_id, resp.arrow_ipc, resp.num_groups) == ("", b"", 0)
    assert replay.info() == before


# ---- Ack / Release -------------------------------------------------------------------------------
LEASE_IDS = st.lists(st.text(max_size=40), min_size=1, max_size=5)


@given(unknown=LEASE_IDS, with_real=st.booleans(), method=st.sampled_from(["Ack", "Release"]))
def test_unknown_lease_ids_are_not_found_and_the_real_lease_survives(replay, unknown, with_real, method):
    ids = ([replay.lease] if with_real else []) + unknown
    request_type = replay_pb2.AckRequest if method == "Ack" else replay_pb2.ReleaseRequest
    err = assert_rejected(replay, lambda: getattr(replay.stub, method)(request_type(lease_ids=ids), timeout=10),
                          f"unknown lease id {unknown[0]!r}")
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert replay.info()["active_leases"] == 1  # the real lease is still held: nothing was half-acked


# ---- LeasePrompts --------------------------------------------------------------------------------
@given(count=st.integers(4097, 2**32 - 1), ttl=st.floats(0, 1e9), consumer=st.text(max_size=20))
def test_lease_of_too_many_prompts(replay, count, ttl, consumer):
    request = replay_pb2.LeasePromptsRequest(consumer=consumer, count=count, ttl_s=ttl)
    assert_rejected(replay, lambda: replay.stub.LeasePrompts(request, timeout=10), f"count ({count}) must be <= 4096")


@given(count=st.integers(0, 4096), ttl=st.one_of(st.floats(max_value=-1e-30), st.just(math.nan)))
def test_lease_with_a_negative_or_nan_ttl(replay, count, ttl):
    request = replay_pb2.LeasePromptsRequest(consumer="fuzz", count=count, ttl_s=ttl)
    assert_rejected(replay, lambda: replay.stub.LeasePrompts(request, timeout=10), "ttl_s (")


# ---- Rejoin --------------------------------------------------------------------------------------
@given(version=st.integers(-(2**63), -1), consumer=st.text(min_size=1, max_size=20))
def test_rejoin_at_a_negative_version(replay, version, consumer):
    request = replay_pb2.RejoinRequest(consumer=consumer, learner_version=version)
    assert_rejected(replay, lambda: replay.stub.Rejoin(request, timeout=10), f"learner_version ({version})")


@given(version=INT64)
def test_rejoin_without_a_consumer_name(replay, version):
    request = replay_pb2.RejoinRequest(consumer="", learner_version=version)
    assert_rejected(replay, lambda: replay.stub.Rejoin(request, timeout=10), "consumer must be a non-empty name")


# ---- UpdatePriorities ----------------------------------------------------------------------------
GROUP_IDS = st.lists(st.text(max_size=12), min_size=1, max_size=4)


@given(group_ids=GROUP_IDS, extra=st.integers(1, 3), shorter=st.booleans())
def test_priorities_of_another_length(replay, group_ids, extra, shorter):
    priorities = [1.0] * (max(len(group_ids) - extra, 0) if shorter else len(group_ids) + extra)
    request = replay_pb2.UpdatePrioritiesRequest(group_ids=group_ids, priorities=priorities)
    assert_rejected(replay, lambda: replay.stub.UpdatePriorities(request, timeout=10),
                    f"{len(group_ids)} group_ids but {len(priorities)} priorities")


@given(group_ids=GROUP_IDS, bad=st.one_of(st.floats(max_value=-1e-300), st.sampled_from([math.inf, math.nan])),
       data=st.data())
def test_negative_or_non_finite_priority(replay, group_ids, bad, data):
    at = data.draw(st.integers(0, len(group_ids) - 1))
    priorities = [1.0] * len(group_ids)
    priorities[at] = bad
    request = replay_pb2.UpdatePrioritiesRequest(group_ids=group_ids, priorities=priorities)
    assert_rejected(replay, lambda: replay.stub.UpdatePriorities(request, timeout=10),
                    f"priority {bad} for group {group_ids[at]!r} must be finite and >= 0")


@given(group_ids=st.lists(st.text(min_size=1, max_size=12).filter(lambda s: "-" not in s), min_size=1, max_size=4))
def test_priorities_of_unknown_groups_are_reported_not_stored(replay, group_ids):
    before = replay.info()
    resp = replay.stub.UpdatePriorities(replay_pb2.UpdatePrioritiesRequest(
        group_ids=group_ids, priorities=[2.0] * len(group_ids)), timeout=10)
    assert (resp.updated, list(resp.unknown_group_ids)) == (0, group_ids)
    assert replay.info() == before


# ---- wire level ----------------------------------------------------------------------------------
@given(garbage=st.binary(min_size=1, max_size=64), method=st.sampled_from(
    ["Sample", "Ack", "Release", "LeasePrompts", "UpdatePriorities", "Info"]))
def test_undecodable_request_bytes_leave_the_server_up(replay, garbage, method):
    """Bytes that are not the request message: grpcio's own deserializer refuses them (INTERNAL,
    "Exception deserializing request!") or proto3 ignores unknown fields; the servicer is never reached
    with a broken message and nothing changes."""
    call = replay.channel.unary_unary(f"/gyre.replay.v1.ReplayService/{method}")
    before = replay.info()
    try:
        call(garbage, timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() in {grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT,
                              grpc.StatusCode.NOT_FOUND}, f"{exc.code().name}: {exc.details()}"
        if exc.code() == grpc.StatusCode.INTERNAL:
            assert "deserializing request" in exc.details()
    if method != "LeasePrompts":  # a decodable LeasePrompts with a small count is a valid lease
        assert _without_wal(replay.info()) == _without_wal(before)
    assert replay.healthy()


# ---- known bugs: the server accepts or crashes on these (see the report) --------------------------
def _nullable_fields(t: pa.Table) -> pa.Table:
    return t.cast(pa.schema([f.with_nullable(True) for f in t.schema], metadata=t.schema.metadata))


KNOWN_BAD = [
    pytest.param(_nullable_fields, "nullable", id="nullable-fields"),
    pytest.param(lambda t: t.append_column("extra", pa.array(range(t.num_rows))), "extra", id="extra-column"),
    pytest.param(lambda t: t.select(t.column_names[::-1]), "order", id="reordered-columns"),
    pytest.param(lambda t: group_table(-5), "prompt_index", id="negative-prompt-index"),
]


@pytest.mark.parametrize("damage, names", KNOWN_BAD)
def test_known_bad_tables_are_invalid_argument(replay, damage, names):
    payload = raw_ipc(damage(group_table(2 * 10**9)))
    assert_rejected(replay, lambda: replay.insert(payload), names)
    assert replay.insert_fresh_group().accepted == 4
