from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutStartStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_START_STATUS_UNSPECIFIED: _ClassVar[PutStartStatus]
    PUT_START_OK: _ClassVar[PutStartStatus]
    PUT_START_EXISTS: _ClassVar[PutStartStatus]
    PUT_START_NO_SPACE: _ClassVar[PutStartStatus]
    PUT_START_NOT_ENOUGH_NODES: _ClassVar[PutStartStatus]
    PUT_START_WRITING: _ClassVar[PutStartStatus]
PUT_START_STATUS_UNSPECIFIED: PutStartStatus
PUT_START_OK: PutStartStatus
PUT_START_EXISTS: PutStartStatus
PUT_START_NO_SPACE: PutStartStatus
PUT_START_NOT_ENOUGH_NODES: PutStartStatus
PUT_START_WRITING: PutStartStatus

class Replica(_message.Message):
    __slots__ = ("node_id", "address", "offset", "capability")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    offset: int
    capability: bytes
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., offset: _Optional[int] = ..., capability: _Optional[bytes] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("key", "size", "lease_s", "replica_num")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    REPLICA_NUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    size: int
    lease_s: float
    replica_num: int
    def __init__(self, key: _Optional[bytes] = ..., size: _Optional[int] = ..., lease_s: _Optional[float] = ..., replica_num: _Optional[int] = ...) -> None: ...

class PutStartResponse(_message.Message):
    __slots__ = ("status", "replicas")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    status: PutStartStatus
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, status: _Optional[_Union[PutStartStatus, str]] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class PutEndRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...

class PutEndResponse(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class PutRevokeRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...

class PutRevokeResponse(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class BatchPutStartRequest(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[PutStartRequest]
    def __init__(self, entries: _Optional[_Iterable[_Union[PutStartRequest, _Mapping]]] = ...) -> None: ...

class BatchPutStartResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutStartResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[PutStartResponse, _Mapping]]] = ...) -> None: ...

class BatchPutEndRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BatchPutEndResponse(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ok: _Optional[_Iterable[bool]] = ...) -> None: ...

class BatchPutRevokeRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BatchPutRevokeResponse(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ok: _Optional[_Iterable[bool]] = ...) -> None: ...

class GetReplicaListRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...

class GetReplicaListResponse(_message.Message):
    __slots__ = ("found", "size", "replicas")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    found: bool
    size: int
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, found: _Optional[bool] = ..., size: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class BatchGetReplicaListRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BatchGetReplicaListResponse(_message.Message):
    __slots__ = ("lists",)
    LISTS_FIELD_NUMBER: _ClassVar[int]
    lists: _containers.RepeatedCompositeFieldContainer[GetReplicaListResponse]
    def __init__(self, lists: _Optional[_Iterable[_Union[GetReplicaListResponse, _Mapping]]] = ...) -> None: ...

class BatchExistsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BatchExistsResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ...) -> None: ...

class PrefixLookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefixLookupResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("keys", "force", "auth")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    force: bool
    auth: bytes
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., force: _Optional[bool] = ..., auth: _Optional[bytes] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "address", "capacity", "incarnation", "auth")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    capacity: int
    incarnation: str
    auth: bytes
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., capacity: _Optional[int] = ..., incarnation: _Optional[str] = ..., auth: _Optional[bytes] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s",)
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: str
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStats(_message.Message):
    __slots__ = ("node_id", "address", "capacity", "used")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    capacity: int
    used: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., capacity: _Optional[int] = ..., used: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("objects", "evictions", "nodes")
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    objects: int
    evictions: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStats]
    def __init__(self, objects: _Optional[int] = ..., evictions: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeStats, _Mapping]]] = ...) -> None: ...
