from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreItem(_message.Message):
    __slots__ = ("prompt_json", "completion", "reference")
    PROMPT_JSON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    prompt_json: str
    completion: str
    reference: str
    def __init__(self, prompt_json: _Optional[str] = ..., completion: _Optional[str] = ..., reference: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("spec_json", "items")
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    spec_json: str
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, spec_json: _Optional[str] = ..., items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class ScoreReply(_message.Message):
    __slots__ = ("scores", "errors", "version")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    errors: _containers.RepeatedScalarFieldContainer[str]
    version: str
    def __init__(self, scores: _Optional[_Iterable[float]] = ..., errors: _Optional[_Iterable[str]] = ..., version: _Optional[str] = ...) -> None: ...
