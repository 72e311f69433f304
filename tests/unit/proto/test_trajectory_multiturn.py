"""Schema version 4: the multi-turn columns' invariants, and version-3 data upgraded on read."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from gyre.proto.trajectory import SCHEMA_VERSION, SchemaError, from_ipc, from_table, to_ipc, to_table
from gyre.proto.trajectory_upgrade import V3_SCHEMA, read_ipc, upgrade
from tests.fakes import make_group


def episode_row(**kw):
    """A 6-token two-turn row: model 2, observation 2, model 2."""
    base = dataclasses.replace(make_group(0, n=1)[0], response_token_ids=[10, 11, 20, 21, 12, 13],
                               behaviour_logprobs=[-0.5, -0.25, 0.0, 0.0, -0.75, -1.5],
                               loss_mask=[1, 1, 0, 0, 1, 1], turn_starts=[0, 4], tool_calls=1,
                               episode_end="done")
    return dataclasses.replace(base, **kw)


def test_single_turn_rows_default_to_a_full_mask_and_one_turn():
    row = make_group(0, n=1, response_len=5)[0]
    assert (row.loss_mask, row.turn_starts, row.tool_calls, row.episode_end) == ([1] * 5, [0], 0, "")
    assert from_table(from_ipc(to_ipc(to_table([row])))) == [row]


def test_episode_row_round_trips():
    row = episode_row()
    assert from_table(from_ipc(to_ipc(to_table([row])))) == [row]


@pytest.mark.parametrize("change, message", [
    (dict(loss_mask=[1, 1, 0]), "loss_mask has 3 entries but the response has 6 tokens"),
    (dict(loss_mask=[1, 1, 2, 0, 1, 1]), "loss_mask holds 2 at token 2; expected 0 or 1"),
    (dict(turn_starts=[]), "turn_starts is empty"),
    (dict(turn_starts=[1, 4]), "the first turn must start at token 0"),
    (dict(turn_starts=[0, 4, 4]), "turn starts must strictly increase"),
    (dict(turn_starts=[0, 6]), "a turn starts past the response's last token"),
    (dict(turn_starts=[0, 3]), "a turn starts on a token with loss_mask 0"),
    (dict(tool_calls=1, tool_errors=2), "tool_calls 1, tool_errors 2; expected 0 <= tool_errors <= tool_calls"),
    (dict(tool_calls=-1, tool_errors=0), "tool_calls -1, tool_errors 0; expected 0 <= tool_errors"),
    (dict(episode_end="bored"), "episode_end 'bored'; expected one of"),
])
def test_bad_multi_turn_columns_are_refused_naming_the_row(change, message):
    good = episode_row()
    with pytest.raises(SchemaError, match=r"row 1 \(0-0-0, group 0-0\): " + message.replace("(", r"\(")):
        to_table([good, episode_row(**change)])


def v3_table(rows):
    """``rows`` as version 3 wrote them (the multi-turn columns absent, metadata 3)."""
    t = to_table(rows)
    return pa.Table.from_arrays([t.column(n) for n in V3_SCHEMA.names], schema=V3_SCHEMA)


def test_version_3_tables_and_payloads_upgrade_to_exactly_the_single_turn_rows():
    rows = make_group(0, n=3, response_len=4) + make_group(1, n=3, response_len=0)
    old = v3_table(rows)
    assert old.schema.metadata[b"gyre.schema_version"] == b"3"
    assert from_table(upgrade(old, "test")) == rows
    chunked = pa.concat_tables([old.slice(0, 2), old.slice(2)])  # offsets not from 0 in the second chunk
    assert from_table(upgrade(chunked, "test")) == rows
    assert from_table(read_ipc(to_ipc(old), "spool file x")) == rows  # a version-3 spool file reads as version 4
    with pytest.raises(SchemaError, match="trajectory schema version 3 is not supported"):
        from_ipc(to_ipc(old))  # the wire does not upgrade


def test_unknown_versions_and_mislabelled_tables_are_refused_naming_the_source():
    t = to_table(make_group(0)).replace_schema_metadata({b"gyre.schema_version": b"2"})
    with pytest.raises(SchemaError, match=f"wal/7.arrow: trajectory schema version 2 is not supported; "
                                          f"expected {SCHEMA_VERSION}"):
        upgrade(t, "wal/7.arrow")
    lying = to_table(make_group(0)).replace_schema_metadata({b"gyre.schema_version": b"3"})
    with pytest.raises(SchemaError, match="declares trajectory schema version 3 but its columns are"):
        upgrade(lying, "snap")


def test_upgrade_keeps_large_tables_vectorised():
    rows = [dataclasses.replace(r, response_token_ids=list(range(i % 7)), behaviour_logprobs=[-1.0] * (i % 7),
                                loss_mask=None) for i, r in enumerate(make_group(0, n=200))]
    new = upgrade(v3_table(rows), "big")
    masks = new.column("loss_mask").to_pylist()
    assert [len(m) for m in masks] == [i % 7 for i in range(200)] and np.all(np.concatenate(masks) == 1)
