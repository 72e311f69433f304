"""Batched inserts: ``TrajectoryBuffer.insert_batch`` (one split, one WAL write, one apply for several
inserts) stores exactly what the same inserts one by one store, and a restart restores it; the
server's ingest stage (``services.replay.ingest``) answers every stream in request order and stops a
stream at its first bad request without touching the others."""

import shutil
import time

import grpc
import pyarrow as pa
import pytest

from gyre.proto import replay_pb2
from gyre.proto.trajectory import SCHEMA_VERSION, to_ipc
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.replay.groups import split_batch, split_groups
from gyre.replay.wal_read import list_segments, read_segment
from gyre.services.replay.ingest import END, Abort, IngestStage, Received, Stream
from tests.fakes import FakeClock, group_table
from tests.unit.replay.test_replay_durability import contents

NO_AUTO = {"interval_s": None, "wal_bytes": None}


def config(path, **kw):
    return ReplayConfig(dir=str(path), seed=0, snapshot=NO_AUTO, **kw)


def inserts():
    """Four inserts: fresh groups, a group of an already completed prompt (duplicates), a stale group
    (dropped), and a group of several versions."""
    tables = [pa.concat_tables([group_table(10, version=5), group_table(11, n=3, version=5)]),
              pa.concat_tables([group_table(1), group_table(12, version=5)]),  # 1: already complete
              pa.concat_tables([group_table(13, version=0), group_table(14, version=5)]),  # 13: stale
              group_table(15, spans=([0, 1], [4, 5]))]
    return [(t, to_ipc(t)) for t in tables]


def stored(buf):
    """``contents`` without lease ids (random per lease)."""
    state, groups = contents(buf)
    state["leases"] = [lease[1:] for lease in state["leases"]]
    return state, groups


def primed(path, clock, **kw):
    buf = TrajectoryBuffer(config(path, max_staleness=2, **kw), clock=clock)
    buf.insert(group_table(1, version=5))
    assert buf.sample(1, learner_version=5) is not None  # learner at 5: version 0 is stale now
    return buf


def test_split_batch_gives_the_groups_and_bytes_of_split_groups_one_by_one():
    items = [(t, p) for t, p in inserts() if t.num_rows]
    one_by_one = [split_groups(t, len(p)) for t, p in items[:3]]
    plan = split_batch([t for t, _ in items[:3]], [len(p) for _, p in items[:3]])
    assert plan.group_ids == [g for p in one_by_one for g in p.group_ids]
    assert plan.nbytes == [b for p in one_by_one for b in p.nbytes]
    assert plan.offset == [o for p in one_by_one for o in p.offset]
    assert plan.part == [i for i, p in enumerate(one_by_one) for _ in p.group_ids] and plan.parts == 3
    assert all(src is items[i][0] for src, i in zip(plan.sources, plan.part))  # each group keeps its insert's table


def test_split_batch_declines_what_only_one_by_one_can_say():
    good, again = group_table(30), group_table(30)  # the same group twice: the second is a retry
    i = good.schema.get_field_index("reward")
    bad = group_table(31).set_column(i, good.schema.field(i), pa.array([float("nan")] * 4, pa.float32()))
    other_version = good.replace_schema_metadata({})
    interleaved = pa.concat_tables([group_table(32), group_table(33)]).take([0, 4, 1, 5, 2, 6, 3, 7])
    assert split_groups(interleaved).group_ids == ["32-0", "33-0"]  # fine alone (one reordered copy)
    assert split_batch([good, interleaved], [1, 1]) is None
    assert split_batch([good, again], [1, 1]) is None
    assert split_batch([good, bad], [1, 1]) is None
    assert split_batch([good, other_version], [1, 1]) is None
    with pytest.raises(ValueError, match="2 tables and 1 sizes"):
        split_batch([good, again], [1])


def test_a_batch_stores_and_logs_what_the_inserts_one_by_one_do(tmp_path):
    clock = FakeClock(1000.0)
    one, batch = primed(tmp_path / "one", clock), primed(tmp_path / "batch", clock)
    singly = [one.insert_nowait(t, p)[0] for t, p in inserts()]
    answers = batch.insert_batch(inserts())
    assert [r for r, _ in answers] == singly
    assert [(r.accepted, r.duplicates, r.dropped_stale) for r in singly] == [(7, 0, 0), (4, 4, 0), (4, 0, 4), (4, 0, 0)]
    batch.wait_durable(max(lsn for _, lsn in answers))
    assert stored(batch) == stored(one)
    assert batch.info()["stored_bytes"] == one.info()["stored_bytes"]
    logs = [[(r.kind, r.payload) for seg in list_segments(tmp_path / name / "wal") for r in read_segment(seg).records]
            for name in ("one", "batch")]
    assert logs[0] == logs[1] and [k for k, _ in logs[0]].count("insert") == 5  # one record per insert either way
    shutil.copytree(tmp_path / "batch", tmp_path / "crashed")  # a kill -9 image
    restored = TrajectoryBuffer(config(tmp_path / "crashed", max_staleness=2), clock=clock)
    assert contents(restored) == contents(batch)
    for b in (one, batch, restored):
        b.close()


def test_a_batch_the_buffer_cannot_take_as_one_step_stores_nothing(tmp_path):
    clock = FakeClock(1000.0)
    buf = TrajectoryBuffer(config(tmp_path / "a"), clock=clock)
    retry = [(group_table(40), to_ipc(group_table(40)))] * 2
    assert buf.insert_batch(retry) is None
    assert buf.insert_batch(retry[:1]) is None  # one insert: nothing to batch
    limited = TrajectoryBuffer(config(tmp_path / "b", rate_limiter={"samples_per_insert": 1.0}), clock=clock)
    assert limited.insert_batch(inserts()) is None  # the limiter may hold back any one of them
    assert buf.info()["size_trajectories"] == limited.info()["size_trajectories"] == 0
    buf.close()
    limited.close()


# ---- the server's ingest stage ----------------------------------------------------------------------
def request(table, batch_id, **kw):
    return replay_pb2.InsertRequest(schema_version=kw.get("schema_version", SCHEMA_VERSION), batch_id=batch_id,
                                    arrow_ipc=kw.get("payload", to_ipc(table)))


def drain(stream):
    out = []
    while not stream.answers.empty():
        out.append(stream.answers.get_nowait())
    return out


def test_the_stage_answers_each_stream_in_order_and_stops_only_the_bad_one(tmp_path):
    buf = TrajectoryBuffer(config(tmp_path), clock=FakeClock(1000.0))
    stage, a, b = IngestStage(buf), Stream(), Stream()
    batch = [(a, request(group_table(50), 1), None), (b, request(group_table(60), 7), None),
             (a, request(group_table(51), 2, payload=b"not arrow"), None), (b, request(group_table(61), 8), None),
             (a, request(group_table(52), 3), None), (b, END, None), (a, END, None)]
    stage.store(batch)
    got_a, got_b = drain(a), drain(b)
    assert [r.batch_id for _, r in got_a[:1]] == [1] and isinstance(got_a[1], Abort)
    assert got_a[1].code == grpc.StatusCode.INVALID_ARGUMENT and "batch 2" in got_a[1].message
    assert got_a[2:] == [END] and a.failed  # request 3 came after the bad one: not stored
    assert [(r.batch_id, r.accepted) for _, r in got_b[:2]] == [(7, 4), (8, 4)] and got_b[2:] == [END]
    assert sorted(buf.state.store.key_of) == ["50-0", "60-0", "61-0"]
    buf.close()


def test_the_stage_stores_a_retried_request_once_and_says_so(tmp_path):
    buf = TrajectoryBuffer(config(tmp_path), clock=FakeClock(1000.0))
    stage, a = IngestStage(buf), Stream()
    stage.store([(a, request(group_table(70), 1), None), (a, request(group_table(70), 1), None),
                 (a, request(group_table(71), 2, schema_version=SCHEMA_VERSION + 1), None)])
    first, retry, bad = drain(a)
    assert (first[1].accepted, retry[1].accepted, retry[1].duplicates) == (4, 0, 4)
    assert isinstance(bad, Abort) and f"schema_version {SCHEMA_VERSION + 1}" in bad.message
    buf.close()


def test_the_stage_thread_batches_what_streams_queued(tmp_path, monkeypatch):
    buf = TrajectoryBuffer(config(tmp_path), clock=FakeClock(1000.0))
    stage, a = IngestStage(buf, max_batch=4), Stream()
    sizes = []
    real = stage.store
    monkeypatch.setattr(stage, "store", lambda batch: (sizes.append(len(batch)), real(batch)))
    with buf._prepare_lock:  # hold the stage at its first request while the rest queue up
        stage.submit(a, request(group_table(80), 0))
        deadline = time.monotonic() + 30
        while stage._queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)
        for i in range(1, 6):
            stage.submit(a, request(group_table(80 + i), i))
        stage.submit(a, END)
    answers = [a.answers.get(timeout=30) for _ in range(7)]
    assert [r.batch_id for _, r in answers[:6]] == list(range(6)) and answers[6] is END
    assert sizes[0] == 1 and max(sizes) == 4  # the first waited alone; the queue behind it went in batches of <= 4
    buf.close()


def test_readers_wait_while_the_stage_holds_its_byte_budget(tmp_path):
    """Received, not yet stored payloads are bounded in bytes: a reader waits (gRPC flow control then
    holds its client back) until the stage has stored what is queued; a lone request always fits."""
    import threading

    buf = TrajectoryBuffer(config(tmp_path), clock=FakeClock(1000.0))
    first, second = request(group_table(90), 0), request(group_table(91), 1)
    stage, a = IngestStage(buf, max_queued_bytes=len(first.arrow_ipc) + 10), Stream()
    with buf._prepare_lock:  # the stage holds the first request (stored only once the lock is free)
        stage.submit(a, first)
        waiting = threading.Thread(target=stage.submit, args=(a, second))
        waiting.start()
        waiting.join(timeout=0.5)
        assert waiting.is_alive() and stage._queue.empty()  # the second waits for room, not in the queue
    waiting.join(timeout=30)
    stage.submit(a, END)
    answers = [a.answers.get(timeout=30) for _ in range(3)]
    assert [r.batch_id for _, r in answers[:2]] == [0, 1] and answers[2] is END
    oversized = IngestStage(buf, max_queued_bytes=1)
    oversized.submit(a, request(group_table(92), 2))  # larger than the budget, alone: admitted at once
    assert a.answers.get(timeout=30)[1].accepted == 4
    buf.close()


def test_the_payload_is_read_from_the_request_once_and_stored_without_another_copy(tmp_path, monkeypatch):
    """Reading ``arrow_ipc`` from a protobuf copies 0.5 MB per message: the reader thread does it once
    (``Received``) and the stored groups keep exactly those bytes."""
    buf = TrajectoryBuffer(config(tmp_path), clock=FakeClock(1000.0))
    stage, a = IngestStage(buf), Stream()
    queued = []
    real = stage.store
    monkeypatch.setattr(stage, "store", lambda batch: (queued.extend(batch), real(batch)))
    req = request(group_table(95), 0)
    stage.submit(a, req)
    assert a.answers.get(timeout=30)[1].accepted == 4
    (_, item, _), = queued
    assert isinstance(item, Received) and item.batch_id == 0 and item.arrow_ipc == req.arrow_ipc
    received = pa.py_buffer(item.arrow_ipc).address
    table = next(iter(buf.state.store.groups.values())).table
    addresses = [b.address for col in table.columns for chunk in col.chunks for b in chunk.buffers() if b is not None]
    assert any(received <= addr < received + len(item.arrow_ipc) for addr in addresses)  # a view, not a copy
    buf.close()
