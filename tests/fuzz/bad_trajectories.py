"""Hypothesis strategies for malformed ``InsertRequest.arrow_ipc`` payloads, each with the text the
rejection must contain (the field or value it names).

Every payload here must be refused by replay with INVALID_ARGUMENT; the layouts fuzzing once found
replay accepting or crashing on are pinned in ``test_fuzz_replay_rpc.py`` and ``test_fuzz_replay_crash.py``.
"""

from __future__ import annotations

import math

import pyarrow as pa
from hypothesis import strategies as st

from gyre.proto.trajectory import SCHEMA_VERSION_KEY, TRAJECTORY_SCHEMA
from tests.fakes import group_table

MAX_BATCH_BYTES = 64 * 1024
"""The fuzzed server's ``max_batch_bytes`` (bytes)."""

NOT_IPC = "not an Arrow IPC stream"

# Wrong-but-castable dtypes per column type: the dtype a careless client might send instead.
_WRONG_TYPES = {
    pa.utf8(): [pa.large_utf8(), pa.binary()],
    pa.int64(): [pa.int32(), pa.uint64(), pa.float64()],
    pa.int32(): [pa.int64(), pa.int16(), pa.float32()],
    pa.float32(): [pa.float64(), pa.float16()],
    pa.float64(): [pa.float32(), pa.int64()],
    pa.list_(pa.int32()): [pa.list_(pa.int64()), pa.large_list(pa.int32())],
    pa.list_(pa.int64()): [pa.list_(pa.int32())],
    pa.list_(pa.float32()): [pa.list_(pa.float64()), pa.list_(pa.float16())],
}


def raw_ipc(table: pa.Table) -> bytes:
    """Arrow IPC stream bytes of ``table`` without ``to_ipc``'s validation (to send bad data on purpose)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _set(table: pa.Table, name: str, values: list, type_: pa.DataType | None = None) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, table.schema.field(i), pa.array(values, type_ or table.schema.field(i).type))


@st.composite
def groups(draw) -> pa.Table:
    """A valid group (``[n]`` rows, ``T`` response tokens) of a prompt index no other test uses."""
    return group_table(draw(st.integers(10**6, 10**9)), n=draw(st.integers(1, 4)),
                       response_len=draw(st.integers(1, 6)))


@st.composite
def wrong_schema(draw) -> tuple[bytes, str]:
    """Valid IPC of a table whose schema is wrong: missing column, mistyped column, bad metadata."""
    table, kind = draw(groups()), draw(st.sampled_from(["missing", "dtype", "version", "no_version"]))
    names = TRAJECTORY_SCHEMA.names
    if kind == "missing":
        name = draw(st.sampled_from(names))
        return raw_ipc(table.drop_columns([name])), f"missing column {name!r}"
    if kind == "dtype":
        field = TRAJECTORY_SCHEMA.field(draw(st.sampled_from(names)))
        to = draw(st.sampled_from(_WRONG_TYPES[field.type]))
        col = table.column(field.name).cast(to, safe=False)
        bad = table.set_column(table.schema.get_field_index(field.name), pa.field(field.name, to, False), col)
        return raw_ipc(bad), f"column {field.name!r} has type {to}"
    if kind == "version":
        version = draw(st.integers(0, 2**31).filter(lambda v: v != 2).map(str))
        meta = {**table.schema.metadata, SCHEMA_VERSION_KEY: version.encode()}
        return raw_ipc(table.replace_schema_metadata(meta)), f"trajectory schema version {version} is not supported"
    return raw_ipc(table.replace_schema_metadata({})), "schema metadata lacks gyre.schema_version"


@st.composite
def wrong_rows(draw) -> tuple[bytes, str]:
    """Valid IPC and schema, invalid rows: T mismatch, non-finite reward, spans (lengths, empty, out of
    order), ids, groups, nulls."""
    table = draw(groups())
    n = table.num_rows
    kind = draw(st.sampled_from(["lengths", "reward", "span_len", "span_empty", "span_order", "id", "mixed", "dup",
                                 "null"]))
    row = draw(st.integers(0, n - 1))
    if kind == "lengths":
        lp = table.column("behaviour_logprobs").to_pylist()
        lp[row] = lp[row] + [-0.5] * draw(st.integers(1, 3)) if draw(st.booleans()) else lp[row][:-1]
        return raw_ipc(_set(table, "behaviour_logprobs", lp)), "behaviour_logprobs has"
    if kind == "reward":
        rewards = table.column("reward").to_pylist()
        rewards[row] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        return raw_ipc(_set(table, "reward", rewards)), "is not finite"
    if kind == "span_len":
        versions = table.column("version_span_versions").to_pylist()
        versions[row] = versions[row] + [versions[row][-1] + 1]
        return raw_ipc(_set(table, "version_span_versions", versions)), "differ in length"
    if kind == "span_empty":
        both = _set(_set(table, "version_span_versions", [[]] * n), "version_span_starts", [[]] * n)
        return raw_ipc(both), "version_span_versions is empty"
    if kind == "span_order":  # one span per row (response_len >= 1): a first start > 0, or versions going back
        starts, versions = (table.column(c).to_pylist() for c in ("version_span_starts", "version_span_versions"))
        tokens, version = len(table.column("response_token_ids")[row].as_py()), versions[row][0]
        if tokens < 2 or draw(st.booleans()):
            starts[row], what = [draw(st.integers(1, 2**31 - 1))], "the first span must start at token 0"
        else:
            starts[row], versions[row] = [0, draw(st.integers(1, tokens - 1))], [version + 1, version]
            what = "span versions must not decrease"
        bad = _set(_set(table, "version_span_starts", starts), "version_span_versions", versions)
        ids = table.column("trajectory_id")[row].as_py(), table.column("group_id")[row].as_py()
        return raw_ipc(bad), f"row {row} ({ids[0]}, group {ids[1]}): {what}"
    if kind == "id":
        ids = table.column("trajectory_id").to_pylist()
        ids[row] = draw(st.text(max_size=12).filter(lambda s: s != ids[row]))
        return raw_ipc(_set(table, "trajectory_id", ids)), "trajectory_id"
    if kind == "mixed":
        other = group_table(table.column("prompt_index")[0].as_py() + 1, n=1)
        other = _set(other, "group_id", [table.column("group_id")[0].as_py()])
        other = _set(other, "sample_index", [n])
        other = _set(other, "trajectory_id", [f"{other.column('prompt_index')[0].as_py()}-{n}-0"])
        return raw_ipc(pa.concat_tables([table, other])), "mixes prompt indices"
    if kind == "dup":
        return raw_ipc(pa.concat_tables([table, table.slice(row, 1)])), "appears more than once"
    name = draw(st.sampled_from(["reward", "task", "prompt_index", "response_token_ids"]))
    nullable = pa.schema([f.with_nullable(f.name == name) for f in table.schema], metadata=table.schema.metadata)
    values = table.column(name).to_pylist()
    values[row] = None
    with_null = table.cast(nullable).set_column(table.schema.get_field_index(name), nullable.field(name),
                                                pa.array(values, nullable.field(name).type))
    return raw_ipc(with_null), f"column {name!r} has 1 null values"


@st.composite
def broken_bytes(draw) -> tuple[bytes, str]:
    """Bytes that are not a whole Arrow IPC stream: random, truncated, huge declared sizes, oversize."""
    kind = draw(st.sampled_from(["random", "truncated", "huge_length", "oversize"]))
    if kind == "random":
        data = draw(st.binary(max_size=4096))
        return data, NOT_IPC
    good = raw_ipc(draw(groups()))
    if kind == "truncated":
        # Keep strictly less than the last record batch (its end is 8 bytes before the stream's end:
        # a stream cut inside the end-of-stream marker is still a whole stream).
        return good[: draw(st.integers(0, len(good) - 9))], NOT_IPC
    if kind == "huge_length":
        # The first message's metadata length prefix (after the 0xFFFFFFFF continuation marker) says
        # far more bytes follow than do.
        size = draw(st.integers(len(good), 2**31 - 1))
        return good[:4] + size.to_bytes(4, "little") + good[8:], NOT_IPC
    reps = MAX_BATCH_BYTES // len(good) + 1
    return good * reps, f"limit is {MAX_BATCH_BYTES}"


def bad_payloads():
    """Any malformed payload above, as ``(arrow_ipc bytes, text the status message must contain)``."""
    return st.one_of(broken_bytes(), wrong_schema(), wrong_rows())
