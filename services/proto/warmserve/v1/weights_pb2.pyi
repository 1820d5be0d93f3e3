from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SidecarState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SIDECAR_STATE_UNSPECIFIED: _ClassVar[SidecarState]
    SIDECAR_STATE_HOT: _ClassVar[SidecarState]
    SIDECAR_STATE_COLD: _ClassVar[SidecarState]
    SIDECAR_STATE_BUILT: _ClassVar[SidecarState]
    SIDECAR_STATE_REBUILT: _ClassVar[SidecarState]
SIDECAR_STATE_UNSPECIFIED: SidecarState
SIDECAR_STATE_HOT: SidecarState
SIDECAR_STATE_COLD: SidecarState
SIDECAR_STATE_BUILT: SidecarState
SIDECAR_STATE_REBUILT: SidecarState

class PrepareRequest(_message.Message):
    __slots__ = ("source", "dtype", "force", "cold_policy")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    COLD_POLICY_FIELD_NUMBER: _ClassVar[int]
    source: str
    dtype: str
    force: bool
    cold_policy: str
    def __init__(self, source: _Optional[str] = ..., dtype: _Optional[str] = ..., force: _Optional[bool] = ..., cold_policy: _Optional[str] = ...) -> None: ...

class SidecarFile(_message.Message):
    __slots__ = ("name", "size_bytes", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class SidecarHandle(_message.Message):
    __slots__ = ("path", "fingerprint", "size_bytes", "residency", "state", "family", "dtype", "source", "files", "seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    fingerprint: str
    size_bytes: int
    residency: float
    state: SidecarState
    family: str
    dtype: str
    source: str
    files: _containers.RepeatedCompositeFieldContainer[SidecarFile]
    seconds: float
    def __init__(self, path: _Optional[str] = ..., fingerprint: _Optional[str] = ..., size_bytes: _Optional[int] = ..., residency: _Optional[float] = ..., state: _Optional[_Union[SidecarState, str]] = ..., family: _Optional[str] = ..., dtype: _Optional[str] = ..., source: _Optional[str] = ..., files: _Optional[_Iterable[_Union[SidecarFile, _Mapping]]] = ..., seconds: _Optional[float] = ...) -> None: ...

class PrepareProgress(_message.Message):
    __slots__ = ("phase", "layers_done", "layers_total", "bytes_written", "message")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_DONE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    phase: str
    layers_done: int
    layers_total: int
    bytes_written: int
    message: str
    def __init__(self, phase: _Optional[str] = ..., layers_done: _Optional[int] = ..., layers_total: _Optional[int] = ..., bytes_written: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PrepareResponse(_message.Message):
    __slots__ = ("progress", "handle")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    progress: PrepareProgress
    handle: SidecarHandle
    def __init__(self, progress: _Optional[_Union[PrepareProgress, _Mapping]] = ..., handle: _Optional[_Union[SidecarHandle, _Mapping]] = ...) -> None: ...

class WeightsFetchRequest(_message.Message):
    __slots__ = ("fingerprint", "source", "dtype", "chunk_bytes")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    source: str
    dtype: str
    chunk_bytes: int
    def __init__(self, fingerprint: _Optional[str] = ..., source: _Optional[str] = ..., dtype: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class WeightsFetchResponse(_message.Message):
    __slots__ = ("handle", "file", "offset", "data")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    handle: SidecarHandle
    file: str
    offset: int
    data: bytes
    def __init__(self, handle: _Optional[_Union[SidecarHandle, _Mapping]] = ..., file: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WeightsListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WeightsListResponse(_message.Message):
    __slots__ = ("sidecars",)
    SIDECARS_FIELD_NUMBER: _ClassVar[int]
    sidecars: _containers.RepeatedCompositeFieldContainer[SidecarHandle]
    def __init__(self, sidecars: _Optional[_Iterable[_Union[SidecarHandle, _Mapping]]] = ...) -> None: ...
