import dataclasses
import math

import pyarrow as pa
import pytest

from proto.trajectory import (SCHEMA_VERSION, SCHEMA_VERSION_KEY, TRAJECTORY_SCHEMA, SchemaError, from_ipc,
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
