from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunnerLoad(_message.Message):
    __slots__ = ("running", "waiting", "kv_blocks_used", "kv_blocks_total")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ...) -> None: ...

class RegisterRunnerRequest(_message.Message):
    __slots__ = ("runner_id", "address", "model", "max_num_seqs", "lease_seconds")
    RUNNER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    runner_id: str
    address: str
    model: str
    max_num_seqs: int
    lease_seconds: float
    def __init__(self, runner_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class RegisterRunnerResponse(_message.Message):
    __slots__ = ("lease_id", "lease_seconds", "heartbeat_interval_seconds")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_seconds: float
    heartbeat_interval_seconds: float
    def __init__(self, lease_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., heartbeat_interval_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("runner_id", "lease_id", "load", "leaving")
    RUNNER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    runner_id: str
    lease_id: str
    load: RunnerLoad
    leaving: bool
    def __init__(self, runner_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., load: _Optional[_Union[RunnerLoad, _Mapping]] = ..., leaving: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "lease_seconds")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    known: bool
    lease_seconds: float
    def __init__(self, known: _Optional[bool] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class ListRunnersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunnerStatus(_message.Message):
    __slots__ = ("runner_id", "address", "model", "state", "outstanding", "lease_expires_in_s", "static", "consecutive_failures", "load")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[RunnerStatus.State]
        STATE_READY: _ClassVar[RunnerStatus.State]
        STATE_UNHEALTHY: _ClassVar[RunnerStatus.State]
        STATE_DRAINING: _ClassVar[RunnerStatus.State]
    STATE_UNSPECIFIED: RunnerStatus.State
    STATE_READY: RunnerStatus.State
    STATE_UNHEALTHY: RunnerStatus.State
    STATE_DRAINING: RunnerStatus.State
    RUNNER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    STATIC_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    runner_id: str
    address: str
    model: str
    state: RunnerStatus.State
    outstanding: int
    lease_expires_in_s: float
    static: bool
    consecutive_failures: int
    load: RunnerLoad
    def __init__(self, runner_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., state: _Optional[_Union[RunnerStatus.State, str]] = ..., outstanding: _Optional[int] = ..., lease_expires_in_s: _Optional[float] = ..., static: _Optional[bool] = ..., consecutive_failures: _Optional[int] = ..., load: _Optional[_Union[RunnerLoad, _Mapping]] = ...) -> None: ...

class ListRunnersResponse(_message.Message):
    __slots__ = ("runners",)
    RUNNERS_FIELD_NUMBER: _ClassVar[int]
    runners: _containers.RepeatedCompositeFieldContainer[RunnerStatus]
    def __init__(self, runners: _Optional[_Iterable[_Union[RunnerStatus, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("runner_id",)
    RUNNER_ID_FIELD_NUMBER: _ClassVar[int]
    runner_id: str
    def __init__(self, runner_id: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
