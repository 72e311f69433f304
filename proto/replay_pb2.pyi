from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InsertRequest(_message.Message):
    __slots__ = ("schema_version", "batch_id", "arrow_ipc")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    batch_id: int
    arrow_ipc: bytes
    def __init__(self, schema_version: _Optional[int] = ..., batch_id: _Optional[int] = ..., arrow_ipc: _Optional[bytes] = ...) -> None: ...

class InsertResponse(_message.Message):
    __slots__ = ("batch_id", "accepted", "duplicates", "dropped_stale")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    accepted: int
    duplicates: int
    dropped_stale: int
    def __init__(self, batch_id: _Optional[int] = ..., accepted: _Optional[int] = ..., duplicates: _Optional[int] = ..., dropped_stale: _Optional[int] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("schema_version", "num_groups", "learner_version", "timeout_s", "consumer", "prompt_indices", "request_id")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDICES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    num_groups: int
    learner_version: int
    timeout_s: float
    consumer: str
    prompt_indices: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    def __init__(self, schema_version: _Optional[int] = ..., num_groups: _Optional[int] = ..., learner_version: _Optional[int] = ..., timeout_s: _Optional[float] = ..., consumer: _Optional[str] = ..., prompt_indices: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("lease_id", "arrow_ipc", "num_groups")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    arrow_ipc: bytes
    num_groups: int
    def __init__(self, lease_id: _Optional[str] = ..., arrow_ipc: _Optional[bytes] = ..., num_groups: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("acked",)
    ACKED_FIELD_NUMBER: _ClassVar[int]
    acked: int
    def __init__(self, acked: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class RejoinRequest(_message.Message):
    __slots__ = ("consumer", "learner_version", "timeline")
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    consumer: str
    learner_version: int
    timeline: int
    def __init__(self, consumer: _Optional[str] = ..., learner_version: _Optional[int] = ..., timeline: _Optional[int] = ...) -> None: ...

class RejoinResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class LeasePromptsRequest(_message.Message):
    __slots__ = ("consumer", "count", "ttl_s", "below_prompt_index", "max_ready_groups", "policy_version")
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    BELOW_PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    MAX_READY_GROUPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    consumer: str
    count: int
    ttl_s: float
    below_prompt_index: int
    max_ready_groups: int
    policy_version: int
    def __init__(self, consumer: _Optional[str] = ..., count: _Optional[int] = ..., ttl_s: _Optional[float] = ..., below_prompt_index: _Optional[int] = ..., max_ready_groups: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class PromptLease(_message.Message):
    __slots__ = ("prompt_index", "attempt")
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    prompt_index: int
    attempt: int
    def __init__(self, prompt_index: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class LeasePromptsResponse(_message.Message):
    __slots__ = ("prompts", "budget")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[PromptLease]
    budget: int
    def __init__(self, prompts: _Optional[_Iterable[_Union[PromptLease, _Mapping]]] = ..., budget: _Optional[int] = ...) -> None: ...

class UpdatePrioritiesRequest(_message.Message):
    __slots__ = ("group_ids", "priorities")
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    priorities: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, group_ids: _Optional[_Iterable[str]] = ..., priorities: _Optional[_Iterable[float]] = ...) -> None: ...

class UpdatePrioritiesResponse(_message.Message):
    __slots__ = ("updated", "unknown_group_ids")
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    updated: int
    unknown_group_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, updated: _Optional[int] = ..., unknown_group_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("schema_version", "size_trajectories", "size_groups", "inserted_total", "duplicates_total", "dropped_stale_total", "sampled_groups_total", "leased_groups", "acked_groups_total", "prompts_completed", "learner_version", "inserted_by_newest_version", "inserted_multi_version", "stored_trajectories", "stored_groups", "stored_bytes", "excluded_groups", "active_leases", "prompts_leased", "inserts_per_s", "samples_per_s", "excluded_stale_total", "evicted_groups_total", "consumed_groups_total", "released_groups_total", "expired_groups_total", "staleness_at_sample", "rl_inserted", "rl_sampled", "rl_diff", "rl_min_diff", "rl_max_diff", "wal_bytes", "wal_fsyncs", "wal_segments", "wal_next_lsn", "snapshots_written", "last_snapshot_age_s", "restore_seconds", "restore_records_replayed", "restore_errors", "last_snapshot_seconds", "dead_timeline_total", "dead_timeline_deleted_total", "dropped_stale_fraction", "work_budget_left", "insert_latency_p50_s", "insert_latency_p99_s", "lease_prompts_latency_p50_s", "lease_prompts_latency_p99_s")
    class InsertedByNewestVersionEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class StalenessAtSampleEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    SIZE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    INSERTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_GROUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LEASED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ACKED_GROUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSERTED_BY_NEWEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSERTED_MULTI_VERSION_FIELD_NUMBER: _ClassVar[int]
    STORED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    STORED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_LEASED_FIELD_NUMBER: _ClassVar[int]
    INSERTS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_STALE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVICTED_GROUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_GROUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RELEASED_GROUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_GROUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STALENESS_AT_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    RL_INSERTED_FIELD_NUMBER: _ClassVar[int]
    RL_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    RL_DIFF_FIELD_NUMBER: _ClassVar[int]
    RL_MIN_DIFF_FIELD_NUMBER: _ClassVar[int]
    RL_MAX_DIFF_FIELD_NUMBER: _ClassVar[int]
    WAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WAL_FSYNCS_FIELD_NUMBER: _ClassVar[int]
    WAL_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    WAL_NEXT_LSN_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    LAST_SNAPSHOT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_RECORDS_REPLAYED_FIELD_NUMBER: _ClassVar[int]
    RESTORE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    LAST_SNAPSHOT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEAD_TIMELINE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEAD_TIMELINE_DELETED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    WORK_BUDGET_LEFT_FIELD_NUMBER: _ClassVar[int]
    INSERT_LATENCY_P50_S_FIELD_NUMBER: _ClassVar[int]
    INSERT_LATENCY_P99_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_PROMPTS_LATENCY_P50_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_PROMPTS_LATENCY_P99_S_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    size_trajectories: int
    size_groups: int
    inserted_total: int
    duplicates_total: int
    dropped_stale_total: int
    sampled_groups_total: int
    leased_groups: int
    acked_groups_total: int
    prompts_completed: int
    learner_version: int
    inserted_by_newest_version: _containers.ScalarMap[int, int]
    inserted_multi_version: int
    stored_trajectories: int
    stored_groups: int
    stored_bytes: int
    excluded_groups: int
    active_leases: int
    prompts_leased: int
    inserts_per_s: float
    samples_per_s: float
    excluded_stale_total: int
    evicted_groups_total: int
    consumed_groups_total: int
    released_groups_total: int
    expired_groups_total: int
    staleness_at_sample: _containers.ScalarMap[int, int]
    rl_inserted: int
    rl_sampled: int
    rl_diff: float
    rl_min_diff: float
    rl_max_diff: float
    wal_bytes: int
    wal_fsyncs: int
    wal_segments: int
    wal_next_lsn: int
    snapshots_written: int
    last_snapshot_age_s: float
    restore_seconds: float
    restore_records_replayed: int
    restore_errors: int
    last_snapshot_seconds: float
    dead_timeline_total: int
    dead_timeline_deleted_total: int
    dropped_stale_fraction: float
    work_budget_left: int
    insert_latency_p50_s: float
    insert_latency_p99_s: float
    lease_prompts_latency_p50_s: float
    lease_prompts_latency_p99_s: float
    def __init__(self, schema_version: _Optional[int] = ..., size_trajectories: _Optional[int] = ..., size_groups: _Optional[int] = ..., inserted_total: _Optional[int] = ..., duplicates_total: _Optional[int] = ..., dropped_stale_total: _Optional[int] = ..., sampled_groups_total: _Optional[int] = ..., leased_groups: _Optional[int] = ..., acked_groups_total: _Optional[int] = ..., prompts_completed: _Optional[int] = ..., learner_version: _Optional[int] = ..., inserted_by_newest_version: _Optional[_Mapping[int, int]] = ..., inserted_multi_version: _Optional[int] = ..., stored_trajectories: _Optional[int] = ..., stored_groups: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., excluded_groups: _Optional[int] = ..., active_leases: _Optional[int] = ..., prompts_leased: _Optional[int] = ..., inserts_per_s: _Optional[float] = ..., samples_per_s: _Optional[float] = ..., excluded_stale_total: _Optional[int] = ..., evicted_groups_total: _Optional[int] = ..., consumed_groups_total: _Optional[int] = ..., released_groups_total: _Optional[int] = ..., expired_groups_total: _Optional[int] = ..., staleness_at_sample: _Optional[_Mapping[int, int]] = ..., rl_inserted: _Optional[int] = ..., rl_sampled: _Optional[int] = ..., rl_diff: _Optional[float] = ..., rl_min_diff: _Optional[float] = ..., rl_max_diff: _Optional[float] = ..., wal_bytes: _Optional[int] = ..., wal_fsyncs: _Optional[int] = ..., wal_segments: _Optional[int] = ..., wal_next_lsn: _Optional[int] = ..., snapshots_written: _Optional[int] = ..., last_snapshot_age_s: _Optional[float] = ..., restore_seconds: _Optional[float] = ..., restore_records_replayed: _Optional[int] = ..., restore_errors: _Optional[int] = ..., last_snapshot_seconds: _Optional[float] = ..., dead_timeline_total: _Optional[int] = ..., dead_timeline_deleted_total: _Optional[int] = ..., dropped_stale_fraction: _Optional[float] = ..., work_budget_left: _Optional[int] = ..., insert_latency_p50_s: _Optional[float] = ..., insert_latency_p99_s: _Optional[float] = ..., lease_prompts_latency_p50_s: _Optional[float] = ..., lease_prompts_latency_p99_s: _Optional[float] = ...) -> None: ...
