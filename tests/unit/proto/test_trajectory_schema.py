import dataclasses
import math

import pyarrow as pa
import pytest

from gyre.proto.trajectory import (SCHEMA_VERSION, SCHEMA_VERSION_KEY, TRAJECTORY_SCHEMA, SchemaError, from_ipc,
                              from_table, to_ipc, to_table)
from tests.fakes import make_group


def test_ipc_round_trip_preserves_every_field():
    rows = make_group(5, n=3, spans=([0, 2], [4, 5]), response_len=4)
    back = from_table(from_ipc(to_ipc(to_table(rows))))
    assert back == rows
    assert back[0].oldest_version == 4 and back[0].newest_version == 5
    assert from_ipc(to_ipc(to_table(rows))).schema.metadata[SCHEMA_VERSION_KEY] == str(SCHEMA_VERSION).encode()


def test_wrong_schema_version_names_both_versions():
    table = to_table(make_group(0)).replace_schema_metadata({SCHEMA_VERSION_KEY: b"99"})
    with pytest.raises(SchemaError, match=f"99 is not supported; expected {SCHEMA_VERSION}"):
        from_ipc(to_ipc(table))


def test_missing_column_is_named():
    table = to_table(make_group(0)).drop_columns(["reward"])
    with pytest.raises(SchemaError, match="missing column 'reward'"):
        from_ipc(to_ipc(table))


def test_length_mismatch_names_row_and_lengths():
    bad = dataclasses.replace(make_group(0)[1], behaviour_logprobs=[-1.0])
    with pytest.raises(SchemaError, match=r"row 0 \(0-1-0\).*3 tokens but behaviour_logprobs has 1"):
        to_table([bad])


@pytest.mark.parametrize("reward", [math.nan, math.inf])
def test_non_finite_reward_rejected(reward):
    bad = dataclasses.replace(make_group(0)[0], reward=reward)
    with pytest.raises(SchemaError, match="not finite"):
        to_table([bad])


def test_garbage_bytes_rejected():
    with pytest.raises(SchemaError, match="not an Arrow IPC stream"):
        from_ipc(b"\x00garbage")


def test_wrong_dtype_rejected():
    table = to_table(make_group(0))
    i = table.schema.get_field_index("reward")
    table = table.set_column(i, pa.field("reward", pa.float64()), table.column("reward").cast(pa.float64()))
    table = table.replace_schema_metadata(TRAJECTORY_SCHEMA.metadata)
    with pytest.raises(SchemaError, match="'reward' has type double; expected float"):
        from_ipc(to_ipc(table))


@pytest.mark.parametrize("starts, versions, what", [
    ([1, 2], [0, 1], "the first span must start at token 0"),
    ([0, 2, 2], [0, 1, 2], "span starts must strictly increase"),
    ([0, 3, 1], [0, 1, 2], "span starts must strictly increase"),
    ([0, 4], [0, 1], "a span starts past the response's last token"),
    ([0, 2], [5, 4], "span versions must not decrease"),
])
def test_bad_version_spans_name_row_group_and_spans(starts, versions, what):
    """The invariants the staleness gate reads spans[0] / spans[-1] by: an insert breaking them is refused
    (replay's ``split_groups`` validates every insert with ``validate_table``)."""
    from gyre.replay.groups import split_groups

    rows = make_group(7, n=3, spans=([0, 2], [3, 3]), response_len=4)
    rows[2] = dataclasses.replace(rows[2], version_span_starts=starts, version_span_versions=versions)
    table = pa.Table.from_pydict({f.name: [getattr(r, f.name) for r in rows] for f in TRAJECTORY_SCHEMA},
                                 schema=TRAJECTORY_SCHEMA)
    message = (f"row 2 (7-2-0, group 7-0): {what}; version_span_starts {starts}, "
               f"version_span_versions {versions}, 4 response tokens")
    for check in (to_table, lambda _: from_ipc(_raw_ipc(table)), lambda _: split_groups(table)):
        with pytest.raises(SchemaError) as err:
            check(rows)
        assert str(err.value) == message


def test_valid_version_spans_pass_in_slices_and_chunks():
    one_span_empty = dataclasses.replace(make_group(1, n=1)[0], response_token_ids=[], behaviour_logprobs=[],
                                         loss_mask=None)
    rows = make_group(0, n=2, spans=([0, 1, 3], [2, 2, 5]), response_len=4) + [one_span_empty]
    assert from_table(to_table(rows)) == rows  # equal versions, a start at T - 1, an empty response with [0]
    bad = dataclasses.replace(make_group(9, n=1)[0], version_span_starts=[2], version_span_versions=[0])
    one_chunk = _unchecked([rows[0], bad, rows[1], rows[2]])
    assert from_table(one_chunk.slice(2)) == rows[1:]  # the bad row's spans stay in the buffers, before the slice
    assert from_table(one_chunk.slice(0, 1)) == rows[:1]
    chunks = pa.concat_tables([to_table(rows[:1]), _unchecked([bad]), to_table(rows[1:])])
    for table in (one_chunk, chunks):
        with pytest.raises(SchemaError, match=r"row 1 \(9-0-0, group 9-0\): the first span must start at token 0"):
            from_table(table)


def _unchecked(rows) -> pa.Table:
    return pa.Table.from_pydict({f.name: [getattr(r, f.name) for r in rows] for f in TRAJECTORY_SCHEMA},
                                schema=TRAJECTORY_SCHEMA)


def _raw_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def test_an_unknown_finish_reason_is_named():
    """The overlong filter counts ``length`` as truncated: any other value than ``stop``/``length`` is refused."""
    bad = dataclasses.replace(make_group(0)[1], finish_reason="abort")
    with pytest.raises(SchemaError, match=r"row 0 \(0-1-0\): finish_reason 'abort'; expected one of \('stop', 'length'\)"):
        to_table([bad])
    assert to_table([dataclasses.replace(make_group(0)[1], finish_reason="length")]).num_rows == 1
