"""Reading trajectory data written by an older gyre: version 3 → 4, on read, losing nothing.

Version 4 (``proto.trajectory``) added the multi-turn columns ``loss_mask``, ``turn_starts``, ``tool_calls``,
``tool_errors`` and ``episode_end``. Every version-3 row is a single-turn response, so its version-4 form is
exact: a mask of ones as long as the response, one turn starting at 0, no tool calls, no episode end. Replay's
WAL segments and snapshots and a rollout's spool files written before the upgrade are read through
:func:`upgrade`, so restarting a run on the new code keeps every stored group. Any other version is refused,
naming the source and both versions.

The gRPC wire does not upgrade: an insert declaring another schema version is refused
(``services.replay.ingest``), since rollouts and replay of one run are upgraded together.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from gyre.proto.trajectory import (SCHEMA_VERSION, SCHEMA_VERSION_KEY, TRAJECTORY_SCHEMA, SchemaError, read_stream,
                              validate_table)

UPGRADABLE = (3,)
"""Older trajectory schema versions :func:`upgrade` turns into ``SCHEMA_VERSION``."""

_V4_COLUMNS = ("loss_mask", "turn_starts", "tool_calls", "tool_errors", "episode_end")
V3_SCHEMA = pa.schema([f for f in TRAJECTORY_SCHEMA if f.name not in _V4_COLUMNS],
                      metadata={SCHEMA_VERSION_KEY: b"3"})
"""Version 3's columns (``TRAJECTORY_SCHEMA`` before the multi-turn columns)."""


def schema_version(schema: pa.Schema) -> int | None:
    """The ``gyre.schema_version`` an Arrow schema declares, or ``None`` (missing or not an integer)."""
    raw = (schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def upgrade(table: pa.Table, source: str = "data") -> pa.Table:
    """``table`` in ``TRAJECTORY_SCHEMA``: returned as is when it declares ``SCHEMA_VERSION``, converted from
    version 3 (the columns above appended; row order and values kept), else refused.

    Args:
        table: trajectory rows as read from a file or payload (not yet validated).
        source: what it was read from (a path), for the error.

    Raises:
        SchemaError: a version other than ``SCHEMA_VERSION`` and ``UPGRADABLE`` (or none), naming ``source``
            and both versions; a version-3 table whose columns are not version 3's.
    """
    version = schema_version(table.schema)
    if version == SCHEMA_VERSION:
        return table
    if version not in UPGRADABLE:
        raise SchemaError(f"{source}: trajectory schema version {version} is not supported; expected "
                          f"{SCHEMA_VERSION} (or {', '.join(map(str, UPGRADABLE))}, upgraded on read)")
    if not table.schema.equals(V3_SCHEMA, check_metadata=False):
        raise SchemaError(f"{source}: declares trajectory schema version 3 but its columns are "
                          f"{table.schema.names}; expected {V3_SCHEMA.names}")
    table = table.combine_chunks()
    rows = table.num_rows
    responses = table.column("response_token_ids")
    offsets = (responses.chunk(0).offsets if responses.num_chunks else pa.array([0], pa.int32()))
    offsets = pa.array(np.asarray(offsets) - int(offsets[0].as_py()), pa.int32())
    ones = pa.array(np.ones(int(offsets[-1].as_py()) if len(offsets) else 0, np.int8), pa.int8())
    added = {
        "loss_mask": pa.ListArray.from_arrays(offsets, ones, type=pa.list_(pa.int8())),
        "turn_starts": pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32)),
                                                pa.array(np.zeros(rows, np.int32)), type=pa.list_(pa.int32())),
        "tool_calls": pa.array(np.zeros(rows, np.int32)),
        "tool_errors": pa.array(np.zeros(rows, np.int32)),
        "episode_end": pa.array([""] * rows, pa.utf8()),
    }
    columns = [table.column(f.name) if f.name in table.schema.names else added[f.name] for f in TRAJECTORY_SCHEMA]
    return pa.Table.from_arrays(columns, schema=TRAJECTORY_SCHEMA)


def read_ipc(payload: bytes, source: str) -> pa.Table:
    """Arrow IPC stream bytes read from ``source`` (a file), upgraded (``upgrade``) and validated (``validate_table``).

    Raises:
        SchemaError: unreadable bytes, an unsupported version, or a table ``validate_table`` refuses.
    """
    table = upgrade(read_stream(payload, source), source)
    validate_table(table)
    return table
