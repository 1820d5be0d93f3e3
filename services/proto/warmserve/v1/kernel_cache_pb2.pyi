from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProgramKey(_message.Message):
    __slots__ = ("name", "fingerprint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    fingerprint: str
    def __init__(self, name: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class EntryInfo(_message.Message):
    __slots__ = ("key", "size_bytes", "sha256", "created_unix_s", "last_access_unix_s", "producer", "format", "signature", "fingerprint_parts")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_PARTS_FIELD_NUMBER: _ClassVar[int]
    key: ProgramKey
    size_bytes: int
    sha256: str
    created_unix_s: float
    last_access_unix_s: float
    producer: str
    format: str
    signature: str
    fingerprint_parts: str
    def __init__(self, key: _Optional[_Union[ProgramKey, _Mapping]] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., created_unix_s: _Optional[float] = ..., last_access_unix_s: _Optional[float] = ..., producer: _Optional[str] = ..., format: _Optional[str] = ..., signature: _Optional[str] = ..., fingerprint_parts: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: ProgramKey
    def __init__(self, key: _Optional[_Union[ProgramKey, _Mapping]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("status", "entry")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[LookupResponse.Status]
        STATUS_HIT: _ClassVar[LookupResponse.Status]
        STATUS_MISS: _ClassVar[LookupResponse.Status]
    STATUS_UNSPECIFIED: LookupResponse.Status
    STATUS_HIT: LookupResponse.Status
    STATUS_MISS: LookupResponse.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    status: LookupResponse.Status
    entry: EntryInfo
    def __init__(self, status: _Optional[_Union[LookupResponse.Status, str]] = ..., entry: _Optional[_Union[EntryInfo, _Mapping]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("key", "chunk_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: ProgramKey
    chunk_bytes: int
    def __init__(self, key: _Optional[_Union[ProgramKey, _Mapping]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("entry", "data")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    entry: EntryInfo
    data: bytes
    def __init__(self, entry: _Optional[_Union[EntryInfo, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PublishHeader(_message.Message):
    __slots__ = ("key", "size_bytes", "sha256", "producer", "format", "signature", "fingerprint_parts")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_PARTS_FIELD_NUMBER: _ClassVar[int]
    key: ProgramKey
    size_bytes: int
    sha256: str
    producer: str
    format: str
    signature: str
    fingerprint_parts: str
    def __init__(self, key: _Optional[_Union[ProgramKey, _Mapping]] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., producer: _Optional[str] = ..., format: _Optional[str] = ..., signature: _Optional[str] = ..., fingerprint_parts: _Optional[str] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PublishHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[PublishHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("status", "reason", "entry")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[PublishResponse.Status]
        STATUS_PUBLISHED: _ClassVar[PublishResponse.Status]
        STATUS_ALREADY_PRESENT: _ClassVar[PublishResponse.Status]
        STATUS_REJECTED: _ClassVar[PublishResponse.Status]
    STATUS_UNSPECIFIED: PublishResponse.Status
    STATUS_PUBLISHED: PublishResponse.Status
    STATUS_ALREADY_PRESENT: PublishResponse.Status
    STATUS_REJECTED: PublishResponse.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    status: PublishResponse.Status
    reason: str
    entry: EntryInfo
    def __init__(self, status: _Optional[_Union[PublishResponse.Status, str]] = ..., reason: _Optional[str] = ..., entry: _Optional[_Union[EntryInfo, _Mapping]] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("name_prefix", "with_parts")
    NAME_PREFIX_FIELD_NUMBER: _ClassVar[int]
    WITH_PARTS_FIELD_NUMBER: _ClassVar[int]
    name_prefix: str
    with_parts: bool
    def __init__(self, name_prefix: _Optional[str] = ..., with_parts: _Optional[bool] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[EntryInfo]
    def __init__(self, entries: _Optional[_Iterable[_Union[EntryInfo, _Mapping]]] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatResponse(_message.Message):
    __slots__ = ("root", "entries", "total_bytes", "max_bytes", "hits", "misses", "publishes", "evictions", "quarantined", "claims", "waits", "builds", "takeovers", "leases")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    WAITS_FIELD_NUMBER: _ClassVar[int]
    BUILDS_FIELD_NUMBER: _ClassVar[int]
    TAKEOVERS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    root: str
    entries: int
    total_bytes: int
    max_bytes: int
    hits: int
    misses: int
    publishes: int
    evictions: int
    quarantined: int
    claims: int
    waits: int
    builds: int
    takeovers: int
    leases: int
    def __init__(self, root: _Optional[str] = ..., entries: _Optional[int] = ..., total_bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., publishes: _Optional[int] = ..., evictions: _Optional[int] = ..., quarantined: _Optional[int] = ..., claims: _Optional[int] = ..., waits: _Optional[int] = ..., builds: _Optional[int] = ..., takeovers: _Optional[int] = ..., leases: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("key", "all")
    KEY_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    key: ProgramKey
    all: bool
    def __init__(self, key: _Optional[_Union[ProgramKey, _Mapping]] = ..., all: _Optional[bool] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted", "freed_bytes")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    freed_bytes: int
    def __init__(self, evicted: _Optional[int] = ..., freed_bytes: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("key", "lease_id", "holder", "expires_unix_s", "ttl_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    key: ProgramKey
    lease_id: str
    holder: str
    expires_unix_s: float
    ttl_s: float
    def __init__(self, key: _Optional[_Union[ProgramKey, _Mapping]] = ..., lease_id: _Optional[str] = ..., holder: _Optional[str] = ..., expires_unix_s: _Optional[float] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("key", "holder", "ttl_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    key: ProgramKey
    holder: str
    ttl_s: float
    def __init__(self, key: _Optional[_Union[ProgramKey, _Mapping]] = ..., holder: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("status", "entry", "lease", "takeover")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[ClaimResponse.Status]
        STATUS_HIT: _ClassVar[ClaimResponse.Status]
        STATUS_OWNER: _ClassVar[ClaimResponse.Status]
        STATUS_WAIT: _ClassVar[ClaimResponse.Status]
        STATUS_PUBLISHED: _ClassVar[ClaimResponse.Status]
        STATUS_LEASE_EXPIRED: _ClassVar[ClaimResponse.Status]
    STATUS_UNSPECIFIED: ClaimResponse.Status
    STATUS_HIT: ClaimResponse.Status
    STATUS_OWNER: ClaimResponse.Status
    STATUS_WAIT: ClaimResponse.Status
    STATUS_PUBLISHED: ClaimResponse.Status
    STATUS_LEASE_EXPIRED: ClaimResponse.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    TAKEOVER_FIELD_NUMBER: _ClassVar[int]
    status: ClaimResponse.Status
    entry: EntryInfo
    lease: Lease
    takeover: bool
    def __init__(self, status: _Optional[_Union[ClaimResponse.Status, str]] = ..., entry: _Optional[_Union[EntryInfo, _Mapping]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ..., takeover: _Optional[bool] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("held", "lease")
    HELD_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    held: bool
    lease: Lease
    def __init__(self, held: _Optional[bool] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: bool
    def __init__(self, held: _Optional[bool] = ...) -> None: ...
