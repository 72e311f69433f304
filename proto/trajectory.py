"""The trajectory: gyre's unit of experience, as an Apache Arrow schema.

One row is one sampled response to one prompt. ``n`` rows that share a ``group_id`` form a GRPO
*group* (same prompt, same attempt) and travel, are stored and are sampled together.

Trajectories cross the wire as Arrow IPC stream bytes inside gRPC messages (``replay.proto``) and
are stored as Arrow record batches. The schema carries ``SCHEMA_VERSION`` in its metadata under
``gyre.schema_version``; a reader refuses bytes whose version differs, naming both.

Fields (``T`` = number of response tokens, ``P`` = number of prompt tokens, ``S`` = number of
policy-version spans):

- ``trajectory_id`` (utf8): ``"{prompt_index}-{sample_index}-{attempt}"``; replay drops duplicates.
- ``group_id`` (utf8): ``"{prompt_index}-{attempt}"``; all samples of one prompt attempt.
- ``prompt_index`` (int64): index of the prompt in the task's deterministic prompt stream.
- ``sample_index`` (int32): 0..n-1 within the group.
- ``attempt`` (int32): how many times this prompt was leased before (0 for the first).
- ``task`` (utf8): task name, e.g. ``"basic_arithmetic"``.
- ``prompt_token_ids`` (list<int32>) ``[P]``: chat-formatted prompt tokens.
- ``response_token_ids`` (list<int32>) ``[T]``: generated tokens.
- ``behaviour_logprobs`` (list<float32>) ``[T]``: log pi_behaviour(token) as reported by vLLM
  (``logprobs_mode="processed_logprobs"``, i.e. after temperature), natural log.
- ``reward`` (float32): scalar reward from the task's verifier, finite.
- ``finish_reason`` (utf8): ``"stop"`` or ``"length"``.
- ``version_span_starts`` (list<int32>) ``[S]``: token offset in the response where each span starts;
  the first is 0, strictly increasing, each ``< T`` (just ``[0]`` for an empty response).
- ``version_span_versions`` (list<int64>) ``[S]``: policy version that produced the tokens of each
  span; non-decreasing. A trajectory generated across a weight update has ``S >= 2``.
- ``reward_fn_version`` (utf8): identifies the verifier that scored the row.
- ``rollout_id`` (utf8): the rollout service instance that generated it.
- ``created_at`` (float64): unix time in seconds when generation finished.
- ``reward_error`` (utf8): ``""`` when the reward function reached a verdict; otherwise why it did not
  (``"raised: <Type>: <message>"``, ``"timeout: ..."``, ``"sandbox-<status>: ..."``), and ``reward`` is 0.0.
- ``policy_timeline`` (int64): timeline (``proto.timeline``: the learner incarnation that published them) of
  the weights that sampled the newest span; 0 when the version numbers alone name the weights (version 0,
  lockstep). A trajectory never spans two timelines but 0 and one other (a rollout cancels its groups in
  flight when it switches timeline), so replay and the learner can tell a crashed learner's versions from the
  resumed learner's same numbers.
- ``loss_mask`` (list<int8>) ``[T]``: 1 for a token the policy sampled (trained on), 0 for a token an environment
  or tool wrote into a multi-turn episode's response (observation, tool result, the template's turn markers);
  all 1 for a single-turn response. Behaviour logprobs of 0-mask tokens are 0.0 and never used.
- ``turn_starts`` (list<int32>) ``[K]``: token offset in the response where each model turn starts (``[0]`` for
  a single-turn response); the first is 0, strictly increasing, each ``< max(T, 1)``, and every model turn's
  first token has mask 1 (an empty response: ``[0]``).
- ``tool_calls`` (int32), ``tool_errors`` (int32): tool calls the episode's model turns made, and how many of
  them failed (bad arguments, unknown tool, crash, timeout); 0 for a single-turn response.
- ``episode_end`` (utf8): why a multi-turn episode ended (``EPISODE_ENDS``): ``"done"`` (the environment said
  so), ``"max_turns"``, ``"max_tokens"`` (the context is full) — ``""`` for a single-turn response. A broken
  episode (the environment raised, the time budget ran out) carries its reason in ``reward_error``
  (``"episode-env_error: ..."``, ``"episode-time_budget: ..."``), which keeps it out of the loss and the baselines.

Version 4 added the last five columns; version-3 data (WAL segments, snapshots, spools) is upgraded on read by
``proto.trajectory_upgrade`` (mask all 1, one turn, no tools), so an upgrade loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SCHEMA_VERSION = 4
"""Bumped on any incompatible change of the columns below."""

SCHEMA_VERSION_KEY = b"gyre.schema_version"

FINISH_REASONS = ("stop", "length")
"""The ``finish_reason`` values a trajectory may carry: ``stop`` (EOS or a stop string) and ``length`` (cut at
the generation budget; what ``AlgorithmConfig.overlong_filter`` masks). vLLM's ``abort`` never reaches replay:
the engine raises on it (``rollout.engine``)."""

EPISODE_ENDS = ("", "done", "max_turns", "max_tokens")
"""The ``episode_end`` values: ``""`` for a single-turn response, else why a multi-turn episode ended."""

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("trajectory_id", pa.utf8(), nullable=False),
        pa.field("group_id", pa.utf8(), nullable=False),
        pa.field("prompt_index", pa.int64(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("attempt", pa.int32(), nullable=False),
        pa.field("task", pa.utf8(), nullable=False),
        pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("behaviour_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("finish_reason", pa.utf8(), nullable=False),
        pa.field("version_span_starts", pa.list_(pa.int32()), nullable=False),
        pa.field("version_span_versions", pa.list_(pa.int64()), nullable=False),
        pa.field("reward_fn_version", pa.utf8(), nullable=False),
        pa.field("rollout_id", pa.utf8(), nullable=False),
        pa.field("created_at", pa.float64(), nullable=False),
        pa.field("reward_error", pa.utf8(), nullable=False),
        pa.field("policy_timeline", pa.int64(), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("turn_starts", pa.list_(pa.int32()), nullable=False),
        pa.field("tool_calls", pa.int32(), nullable=False),
        pa.field("tool_errors", pa.int32(), nullable=False),
        pa.field("episode_end", pa.utf8(), nullable=False),
    ],
    metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()},
)


class SchemaError(ValueError):
    """Arrow bytes or a table that do not match ``TRAJECTORY_SCHEMA``; the message names the field."""


@dataclass(frozen=True)
class Trajectory:
    """One sampled response with everything the learner needs to train on it off-policy.

    Field docs are those of the module docstring; shapes: ``prompt_token_ids [P] int``,
    ``response_token_ids [T] int``, ``behaviour_logprobs [T] float``, ``version_span_* [S]``, ``loss_mask [T]``
    (``None``: all 1, a single-turn response), ``turn_starts [K]`` (``None``: ``[0]``).
    """

    trajectory_id: str
    group_id: str
    prompt_index: int
    sample_index: int
    attempt: int
    task: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    behaviour_logprobs: list[float]
    reward: float
    finish_reason: str
    version_span_starts: list[int]
    version_span_versions: list[int]
    reward_fn_version: str
    rollout_id: str
    created_at: float
    reward_error: str = ""
    policy_timeline: int = 0
    loss_mask: list[int] | None = None
    turn_starts: list[int] | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    episode_end: str = ""

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            object.__setattr__(self, "loss_mask", [1] * len(self.response_token_ids))
        if self.turn_starts is None:
            object.__setattr__(self, "turn_starts", [0])

    @property
    def oldest_version(self) -> int:
        """Policy version of the first response token (the one that bounds staleness)."""
        return self.version_span_versions[0]

    @property
    def newest_version(self) -> int:
        """Policy version of the last span."""
        return self.version_span_versions[-1]


def make_ids(prompt_index: int, sample_index: int, attempt: int) -> tuple[str, str]:
    """Deterministic ``(trajectory_id, group_id)``; retries of the same sample collide on purpose."""
    return f"{prompt_index}-{sample_index}-{attempt}", f"{prompt_index}-{attempt}"


def to_table(trajectories: list[Trajectory]) -> pa.Table:
    """Rows → an Arrow table with ``TRAJECTORY_SCHEMA`` (validated)."""
    cols = {f.name: [getattr(t, f.name) for t in trajectories] for f in TRAJECTORY_SCHEMA}
    table = pa.Table.from_pydict(cols, schema=TRAJECTORY_SCHEMA)
    validate_table(table)
    return table


def from_table(table: pa.Table) -> list[Trajectory]:
    """Arrow table (validated) → rows."""
    validate_table(table)
    return [Trajectory(**row) for row in table.to_pylist()]


def to_ipc(table: pa.Table) -> bytes:
    """Serialise a trajectory table as Arrow IPC stream bytes (the wire payload)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(payload: bytes) -> pa.Table:
    """Parse and validate Arrow IPC stream bytes.

    Older-version bytes are refused here; files written before an upgrade are read with
    ``proto.trajectory_upgrade.read_ipc``.

    Raises:
        SchemaError: unreadable bytes, wrong schema version, missing/mistyped column, or a row whose
            ``response_token_ids`` and ``behaviour_logprobs`` lengths differ, whose reward is not finite, or
            whose version spans break the invariants above (``validate_table``).
    """
    table = read_stream(payload)
    validate_table(table)
    return table


def read_stream(payload: bytes, source: str = "payload") -> pa.Table:
    """Arrow IPC stream bytes → a table, structurally checked (``Table.validate(full=True)``) but not against the
    schema. Raises ``SchemaError`` ("``source`` is not an Arrow IPC stream: ...") for unreadable bytes."""
    try:
        table = pa.ipc.open_stream(payload).read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError) as exc:
        raise SchemaError(f"{source} is not an Arrow IPC stream: {exc}") from exc
    return table


def _check_columns(table: pa.Table) -> None:
    """Schema version, then each column's presence, type and nulls, their order, and non-nullable fields."""
    meta = table.schema.metadata or {}
    got = meta.get(SCHEMA_VERSION_KEY)
    if got is None:
        raise SchemaError(f"schema metadata lacks {SCHEMA_VERSION_KEY.decode()}; expected {SCHEMA_VERSION}")
    if got != str(SCHEMA_VERSION).encode():
        raise SchemaError(
            f"trajectory schema version {got.decode(errors='replace')} is not supported; expected {SCHEMA_VERSION}"
        )
    for field in TRAJECTORY_SCHEMA:
        idx = table.schema.get_field_index(field.name)
        if idx < 0:
            raise SchemaError(f"missing column {field.name!r} (expected {field.type})")
        if table.schema.field(idx).type != field.type:
            raise SchemaError(
                f"column {field.name!r} has type {table.schema.field(idx).type}; expected {field.type}"
            )
        if table.column(idx).null_count:
            raise SchemaError(f"column {field.name!r} has {table.column(idx).null_count} null values")
    if table.schema.names != TRAJECTORY_SCHEMA.names:
        extra = [n for n in table.schema.names if TRAJECTORY_SCHEMA.get_field_index(n) < 0]
        raise SchemaError(f"unknown extra column(s) {extra}; expected exactly {TRAJECTORY_SCHEMA.names}" if extra
                          else f"columns are in order {table.schema.names}; expected {TRAJECTORY_SCHEMA.names}")
    nullable = [f.name for f in table.schema if f.nullable]
    if nullable:
        raise SchemaError(f"column(s) {nullable} are declared nullable; TRAJECTORY_SCHEMA fields are not")


def _list_lengths(table: pa.Table, name: str) -> np.ndarray:
    """``[rows]`` int32 lengths of the list column ``name`` (differences of its offsets, no copy of values)."""
    chunks = [np.diff(chunk.offsets.to_numpy()) for chunk in table.column(name).chunks]
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks or [np.zeros(0, np.int32)])


def validate_table(table: pa.Table) -> None:
    """Check schema version, columns, dtypes and per-row invariants; raise ``SchemaError`` naming the field.

    Per row: as many behaviour logprobs as response tokens, a ``finish_reason`` in ``FINISH_REASONS``, a
    finite reward, and version spans as the
    module docstring states (as many starts as versions, at least one; starts from 0, strictly increasing,
    inside the response; versions non-decreasing), the bad row named by index, trajectory and group id.

    The usual case (the schema equals ``TRAJECTORY_SCHEMA``, metadata included) is one comparison;
    only a different schema is checked field by field to name what differs. Row checks are numpy over
    whole columns (list lengths from offsets), never a per-row Python loop.
    """
    if not table.schema.equals(TRAJECTORY_SCHEMA, check_metadata=True):
        _check_columns(table)
    for idx, name in enumerate(TRAJECTORY_SCHEMA.names):
        nulls = table.column(idx).null_count
        if nulls:
            raise SchemaError(f"column {name!r} has {nulls} null values")
    n_tok, n_lp = _list_lengths(table, "response_token_ids"), _list_lengths(table, "behaviour_logprobs")
    bad = np.flatnonzero(n_tok != n_lp)
    if bad.size:
        i = int(bad[0])
        raise SchemaError(
            f"row {i} ({table.column('trajectory_id')[i].as_py()}): response_token_ids has "
            f"{n_tok[i]} tokens but behaviour_logprobs has {n_lp[i]}"
        )
    finish = table.column("finish_reason")
    bad_finish = pc.invert(pc.is_in(finish, value_set=pa.array(FINISH_REASONS)))
    if pc.any(bad_finish).as_py():
        i = int(pc.index(bad_finish, True).as_py())
        raise SchemaError(f"row {i} ({table.column('trajectory_id')[i].as_py()}): finish_reason "
                          f"{finish[i].as_py()!r}; expected one of {FINISH_REASONS}")
    rewards = table.column("reward").to_numpy()
    if not np.isfinite(rewards).all():
        i = int(np.flatnonzero(~np.isfinite(rewards))[0])
        raise SchemaError(f"row {i}: reward {rewards[i]} is not finite")
    n_spans = _list_lengths(table, "version_span_starts")
    if not np.array_equal(n_spans, _list_lengths(table, "version_span_versions")):
        raise SchemaError("version_span_starts and version_span_versions differ in length")
    if (n_spans == 0).any():
        raise SchemaError("version_span_versions is empty; every trajectory needs at least one span")
    _check_spans(table, n_tok)
    _check_turns(table, n_tok)


def _list_values(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets [rows + 1] from 0, values)`` of the list column ``name`` as numpy, only the values its rows
    cover (a sliced list array's buffer may hold more; ``combine_chunks`` normalises that in pyarrow 26, but
    is not documented to)."""
    col = table.column(name).combine_chunks()
    offsets = col.offsets.to_numpy()
    if len(offsets) == 0:
        return np.zeros(1, np.int64), np.zeros(0, np.int64)
    return offsets - offsets[0], col.values.to_numpy()[offsets[0]: offsets[-1]]


def _check_spans(table: pa.Table, n_tok: np.ndarray) -> None:
    """The version-span invariants replay's staleness gate and the learner's lag rely on (the first span's
    version is the oldest, the last one's the newest): per row, ``version_span_starts`` begins at 0 and
    strictly increases, every start lies inside the response (``< T``; just ``[0]`` for an empty one), and
    ``version_span_versions`` never decreases. Spans are non-empty and as long as each other (checked
    before). Vectorised over all spans; raises ``SchemaError`` naming the row, its trajectory and group
    ids, the spans and what is wrong."""
    offsets, starts = _list_values(table, "version_span_starts")
    _, versions = _list_values(table, "version_span_versions")
    first, last = offsets[:-1], offsets[1:] - 1
    bad_first = starts[first] != 0
    bad_end = starts[last] >= np.maximum(n_tok, 1)
    inner = np.ones(max(len(starts) - 1, 0), bool)  # pair (j, j + 1) lies within one row
    inner[first[1:] - 1] = False
    row_of = np.repeat(np.arange(len(n_tok)), np.diff(offsets))[:-1]  # row of pair (j, j + 1)
    step_start, step_version = np.zeros(len(n_tok), bool), np.zeros(len(n_tok), bool)
    step_start[row_of[inner & (np.diff(starts) <= 0)]] = True
    step_version[row_of[inner & (np.diff(versions) < 0)]] = True
    checks = ((bad_first, "the first span must start at token 0"),
              (step_start, "span starts must strictly increase"),
              (bad_end, "a span starts past the response's last token"),
              (step_version, "span versions must not decrease"))
    for bad, what in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            lo, hi = offsets[i], offsets[i + 1]
            raise SchemaError(
                f"row {i} ({table.column('trajectory_id')[i].as_py()}, group {table.column('group_id')[i].as_py()}): "
                f"{what}; version_span_starts {starts[lo:hi].tolist()}, version_span_versions "
                f"{versions[lo:hi].tolist()}, {int(n_tok[i])} response tokens"
            )


def _row_error(table: pa.Table, i: int, what: str) -> SchemaError:
    return SchemaError(f"row {i} ({table.column('trajectory_id')[i].as_py()}, group "
                       f"{table.column('group_id')[i].as_py()}): {what}")


def _check_turns(table: pa.Table, n_tok: np.ndarray) -> None:
    """The multi-turn columns: ``loss_mask`` as long as the response and only 0/1; ``turn_starts`` non-empty,
    from 0, strictly increasing, inside the response, each on a mask-1 token; tool counts ``0 <= tool_errors <=
    tool_calls``; ``episode_end`` in ``EPISODE_ENDS``. Vectorised; raises ``SchemaError`` naming the row."""
    n_mask = _list_lengths(table, "loss_mask")
    if (bad := np.flatnonzero(n_mask != n_tok)).size:
        i = int(bad[0])
        raise _row_error(table, i, f"loss_mask has {n_mask[i]} entries but the response has {n_tok[i]} tokens")
    m_off, mask = _list_values(table, "loss_mask")
    if mask.size and ((mask != 0) & (mask != 1)).any():
        j = int(np.flatnonzero((mask != 0) & (mask != 1))[0])
        i = int(np.searchsorted(m_off, j, side="right") - 1)
        raise _row_error(table, i, f"loss_mask holds {int(mask[j])} at token {j - m_off[i]}; expected 0 or 1")
    t_off, starts = _list_values(table, "turn_starts")
    n_turns = np.diff(t_off)
    if (n_turns == 0).any():
        raise _row_error(table, int(np.flatnonzero(n_turns == 0)[0]), "turn_starts is empty; expected at least [0]")
    first, last = t_off[:-1], t_off[1:] - 1
    row_of = np.repeat(np.arange(len(n_tok)), n_turns)
    inner = np.ones(max(len(starts) - 1, 0), bool)
    inner[first[1:] - 1] = False
    step = np.zeros(len(n_tok), bool)
    step[row_of[:-1][inner & (np.diff(starts) <= 0)]] = True
    in_range = starts < np.maximum(n_tok, 1)[row_of]
    on_model = np.ones(len(starts), bool)
    has_tok = in_range & (n_tok[row_of] > 0)
    on_model[has_tok] = mask[m_off[row_of[has_tok]] + starts[has_tok]] == 1
    off_model = np.zeros(len(n_tok), bool)
    off_model[row_of[~on_model]] = True
    checks = ((starts[first] != 0, "the first turn must start at token 0"),
              (step, "turn starts must strictly increase"),
              (starts[last] >= np.maximum(n_tok, 1), "a turn starts past the response's last token"),
              (off_model, "a turn starts on a token with loss_mask 0 (turns start with a model token)"))
    for bad, what in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise _row_error(table, i, f"{what}; turn_starts {starts[t_off[i]:t_off[i + 1]].tolist()}, "
                                       f"{int(n_tok[i])} response tokens")
    calls, errors = table.column("tool_calls").to_numpy(), table.column("tool_errors").to_numpy()
    if (bad := np.flatnonzero((calls < 0) | (errors < 0) | (errors > calls))).size:
        i = int(bad[0])
        raise _row_error(table, i, f"tool_calls {calls[i]}, tool_errors {errors[i]}; expected "
                                   "0 <= tool_errors <= tool_calls")
    ends = table.column("episode_end")
    bad_end = pc.invert(pc.is_in(ends, value_set=pa.array(EPISODE_ENDS)))
    if pc.any(bad_end).as_py():
        i = int(pc.index(bad_end, True).as_py())
        raise _row_error(table, i, f"episode_end {ends[i].as_py()!r}; expected one of {EPISODE_ENDS}")
