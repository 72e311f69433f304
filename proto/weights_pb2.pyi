from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubscribeRequest(_message.Message):
    __slots__ = ("have_version", "subscriber", "have_timeline", "base_version", "base_timeline", "incarnation")
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    HAVE_TIMELINE_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_TIMELINE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    have_version: int
    subscriber: str
    have_timeline: int
    base_version: int
    base_timeline: int
    incarnation: str
    def __init__(self, have_version: _Optional[int] = ..., subscriber: _Optional[str] = ..., have_timeline: _Optional[int] = ..., base_version: _Optional[int] = ..., base_timeline: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("version", "name", "dtype", "shape", "offset", "data", "nbytes", "last_of_tensor", "checksum", "last_of_version", "num_tensors", "schema_version", "checksum_kind", "timeline", "chunk_checksum", "encoding", "base_version", "base_timeline")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_OF_TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LAST_OF_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_KIND_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_TIMELINE_FIELD_NUMBER: _ClassVar[int]
    version: int
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    nbytes: int
    last_of_tensor: bool
    checksum: int
    last_of_version: bool
    num_tensors: int
    schema_version: int
    checksum_kind: str
    timeline: int
    chunk_checksum: int
    encoding: str
    base_version: int
    base_timeline: int
    def __init__(self, version: _Optional[int] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., nbytes: _Optional[int] = ..., last_of_tensor: _Optional[bool] = ..., checksum: _Optional[int] = ..., last_of_version: _Optional[bool] = ..., num_tensors: _Optional[int] = ..., schema_version: _Optional[int] = ..., checksum_kind: _Optional[str] = ..., timeline: _Optional[int] = ..., chunk_checksum: _Optional[int] = ..., encoding: _Optional[str] = ..., base_version: _Optional[int] = ..., base_timeline: _Optional[int] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    checksum: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class BroadcastGroup(_message.Message):
    __slots__ = ("group_id", "members", "store_port", "backend", "bucket_bytes", "join_timeout_s", "broadcast_timeout_s")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    members: _containers.RepeatedScalarFieldContainer[str]
    store_port: int
    backend: str
    bucket_bytes: int
    join_timeout_s: float
    broadcast_timeout_s: float
    def __init__(self, group_id: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., store_port: _Optional[int] = ..., backend: _Optional[str] = ..., bucket_bytes: _Optional[int] = ..., join_timeout_s: _Optional[float] = ..., broadcast_timeout_s: _Optional[float] = ...) -> None: ...

class VersionManifest(_message.Message):
    __slots__ = ("version", "tensors", "checksum_kind", "schema_version", "timeline", "group")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_KIND_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    checksum_kind: str
    schema_version: int
    timeline: int
    group: BroadcastGroup
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., checksum_kind: _Optional[str] = ..., schema_version: _Optional[int] = ..., timeline: _Optional[int] = ..., group: _Optional[_Union[BroadcastGroup, _Mapping]] = ...) -> None: ...

class LatestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LatestResponse(_message.Message):
    __slots__ = ("version", "timeline")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    version: int
    timeline: int
    def __init__(self, version: _Optional[int] = ..., timeline: _Optional[int] = ...) -> None: ...
