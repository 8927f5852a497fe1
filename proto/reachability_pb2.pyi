from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReachRequest(_message.Message):
    __slots__ = ("protocol_version", "listener_id", "ports")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LISTENER_ID_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    listener_id: bytes
    ports: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, protocol_version: _Optional[int] = ..., listener_id: _Optional[bytes] = ..., ports: _Optional[_Iterable[int]] = ...) -> None: ...

class DialResult(_message.Message):
    __slots__ = ("address", "reachable", "error")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    address: str
    reachable: bool
    error: str
    def __init__(self, address: _Optional[str] = ..., reachable: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class ReachReply(_message.Message):
    __slots__ = ("results", "error")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DialResult]
    error: str
    def __init__(self, results: _Optional[_Iterable[_Union[DialResult, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...
