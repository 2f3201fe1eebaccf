from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_OK: _ClassVar[KVErrorCode]
    KV_NOT_FOUND: _ClassVar[KVErrorCode]
    KV_PUT_IN_PROGRESS: _ClassVar[KVErrorCode]
    KV_NO_SPACE: _ClassVar[KVErrorCode]
    KV_INVALID: _ClassVar[KVErrorCode]
    KV_NO_PENDING_PUT: _ClassVar[KVErrorCode]
    KV_LEASED: _ClassVar[KVErrorCode]
    KV_NOT_ENOUGH_NODES: _ClassVar[KVErrorCode]
    KV_NOT_OWNER: _ClassVar[KVErrorCode]
    KV_QUARANTINED: _ClassVar[KVErrorCode]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_TCP: _ClassVar[Transport]
    TRANSPORT_MOONCAKE: _ClassVar[Transport]

class StorageTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORAGE_TIER_MEMORY: _ClassVar[StorageTier]
    STORAGE_TIER_DISK: _ClassVar[StorageTier]

class PlacementStrategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACEMENT_UNSPECIFIED: _ClassVar[PlacementStrategy]
    PLACEMENT_FREE_RATIO_FIRST: _ClassVar[PlacementStrategy]
    PLACEMENT_RANDOM: _ClassVar[PlacementStrategy]

class KVEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_UNSPECIFIED: _ClassVar[KVEventType]
    KV_EVENT_STORED: _ClassVar[KVEventType]
    KV_EVENT_REMOVED: _ClassVar[KVEventType]

class KVEventReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_REASON_UNSPECIFIED: _ClassVar[KVEventReason]
    KV_EVENT_REASON_REMOVE: _ClassVar[KVEventReason]
    KV_EVENT_REASON_EVICT: _ClassVar[KVEventReason]
    KV_EVENT_REASON_TTL: _ClassVar[KVEventReason]
    KV_EVENT_REASON_NODE_DEAD: _ClassVar[KVEventReason]
    KV_EVENT_REASON_UNMOUNT: _ClassVar[KVEventReason]
    KV_EVENT_REASON_TIER: _ClassVar[KVEventReason]
KV_OK: KVErrorCode
KV_NOT_FOUND: KVErrorCode
KV_PUT_IN_PROGRESS: KVErrorCode
KV_NO_SPACE: KVErrorCode
KV_INVALID: KVErrorCode
KV_NO_PENDING_PUT: KVErrorCode
KV_LEASED: KVErrorCode
KV_NOT_ENOUGH_NODES: KVErrorCode
KV_NOT_OWNER: KVErrorCode
KV_QUARANTINED: KVErrorCode
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_SHM: Transport
TRANSPORT_TCP: Transport
TRANSPORT_MOONCAKE: Transport
STORAGE_TIER_MEMORY: StorageTier
STORAGE_TIER_DISK: StorageTier
PLACEMENT_UNSPECIFIED: PlacementStrategy
PLACEMENT_FREE_RATIO_FIRST: PlacementStrategy
PLACEMENT_RANDOM: PlacementStrategy
KV_EVENT_UNSPECIFIED: KVEventType
KV_EVENT_STORED: KVEventType
KV_EVENT_REMOVED: KVEventType
KV_EVENT_REASON_UNSPECIFIED: KVEventReason
KV_EVENT_REASON_REMOVE: KVEventReason
KV_EVENT_REASON_EVICT: KVEventReason
KV_EVENT_REASON_TTL: KVEventReason
KV_EVENT_REASON_NODE_DEAD: KVEventReason
KV_EVENT_REASON_UNMOUNT: KVEventReason
KV_EVENT_REASON_TIER: KVEventReason

class Endpoint(_message.Message):
    __slots__ = ("transport", "address", "shm_name", "host_id", "remote_base")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BASE_FIELD_NUMBER: _ClassVar[int]
    transport: Transport
    address: str
    shm_name: str
    host_id: str
    remote_base: int
    def __init__(self, transport: _Optional[_Union[Transport, str]] = ..., address: _Optional[str] = ..., shm_name: _Optional[str] = ..., host_id: _Optional[str] = ..., remote_base: _Optional[int] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("segment_id", "node_id", "size", "endpoints", "tier")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    node_id: str
    size: int
    endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    tier: StorageTier
    def __init__(self, segment_id: _Optional[str] = ..., node_id: _Optional[str] = ..., size: _Optional[int] = ..., endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ..., tier: _Optional[_Union[StorageTier, str]] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("node_id", "segment_id", "offset", "size", "endpoints", "token", "token_expires_ms", "alloc_id", "tier")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    ALLOC_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    segment_id: str
    offset: int
    size: int
    endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    token: bytes
    token_expires_ms: int
    alloc_id: int
    tier: StorageTier
    def __init__(self, node_id: _Optional[str] = ..., segment_id: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ..., token: _Optional[bytes] = ..., token_expires_ms: _Optional[int] = ..., alloc_id: _Optional[int] = ..., tier: _Optional[_Union[StorageTier, str]] = ...) -> None: ...

class PutOptions(_message.Message):
    __slots__ = ("replicas", "soft_pin", "ttl_ms", "placement")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SOFT_PIN_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    replicas: int
    soft_pin: bool
    ttl_ms: int
    placement: PlacementStrategy
    def __init__(self, replicas: _Optional[int] = ..., soft_pin: _Optional[bool] = ..., ttl_ms: _Optional[int] = ..., placement: _Optional[_Union[PlacementStrategy, str]] = ...) -> None: ...

class MountSegmentRequest(_message.Message):
    __slots__ = ("segment", "held", "keeps_bytes", "node_address")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    KEEPS_BYTES_FIELD_NUMBER: _ClassVar[int]
    NODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    segment: Segment
    held: _containers.RepeatedCompositeFieldContainer[HeldObject]
    keeps_bytes: bool
    node_address: str
    def __init__(self, segment: _Optional[_Union[Segment, _Mapping]] = ..., held: _Optional[_Iterable[_Union[HeldObject, _Mapping]]] = ..., keeps_bytes: _Optional[bool] = ..., node_address: _Optional[str] = ...) -> None: ...

class HeldObject(_message.Message):
    __slots__ = ("key", "offset", "size")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    size: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class MountSegmentResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "restored_objects", "data_key")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    DATA_KEY_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    restored_objects: int
    data_key: bytes
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., restored_objects: _Optional[int] = ..., data_key: _Optional[bytes] = ...) -> None: ...

class UnmountSegmentRequest(_message.Message):
    __slots__ = ("segment_id",)
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    def __init__(self, segment_id: _Optional[str] = ...) -> None: ...

class UnmountSegmentResponse(_message.Message):
    __slots__ = ("removed_objects",)
    REMOVED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    removed_objects: int
    def __init__(self, removed_objects: _Optional[int] = ...) -> None: ...

class NodeHeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "segment_ids")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    segment_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., segment_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class NodeHeartbeatResponse(_message.Message):
    __slots__ = ("remount_required",)
    REMOUNT_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    remount_required: bool
    def __init__(self, remount_required: _Optional[bool] = ...) -> None: ...

class PutStartItem(_message.Message):
    __slots__ = ("key", "size", "inline_data", "checksum", "block", "namespace")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    inline_data: bytes
    checksum: bytes
    block: KVBlockMeta
    namespace: int
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., inline_data: _Optional[bytes] = ..., checksum: _Optional[bytes] = ..., block: _Optional[_Union[KVBlockMeta, _Mapping]] = ..., namespace: _Optional[int] = ...) -> None: ...

class KVNamespace(_message.Message):
    __slots__ = ("root", "fingerprint", "labels", "tenant")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROOT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    root: str
    fingerprint: str
    labels: _containers.ScalarMap[str, str]
    tenant: str
    def __init__(self, root: _Optional[str] = ..., fingerprint: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., tenant: _Optional[str] = ...) -> None: ...

class KVBlockMeta(_message.Message):
    __slots__ = ("parent_key", "token_ids", "block_size", "medium", "engine_block_hashes", "engine_parent_block_hash", "engine_block_size")
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    parent_key: str
    token_ids: bytes
    block_size: int
    medium: str
    engine_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    engine_parent_block_hash: bytes
    engine_block_size: int
    def __init__(self, parent_key: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., block_size: _Optional[int] = ..., medium: _Optional[str] = ..., engine_block_hashes: _Optional[_Iterable[bytes]] = ..., engine_parent_block_hash: _Optional[bytes] = ..., engine_block_size: _Optional[int] = ...) -> None: ...

class BatchPutStartRequest(_message.Message):
    __slots__ = ("client_id", "items", "options", "namespaces")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    items: _containers.RepeatedCompositeFieldContainer[PutStartItem]
    options: PutOptions
    namespaces: _containers.RepeatedCompositeFieldContainer[KVNamespace]
    def __init__(self, client_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[PutStartItem, _Mapping]]] = ..., options: _Optional[_Union[PutOptions, _Mapping]] = ..., namespaces: _Optional[_Iterable[_Union[KVNamespace, _Mapping]]] = ...) -> None: ...

class PutStartResult(_message.Message):
    __slots__ = ("key", "code", "message", "already_exists", "replicas")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ALREADY_EXISTS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    key: str
    code: KVErrorCode
    message: str
    already_exists: bool
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, key: _Optional[str] = ..., code: _Optional[_Union[KVErrorCode, str]] = ..., message: _Optional[str] = ..., already_exists: _Optional[bool] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class BatchPutStartResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutStartResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PutStartResult, _Mapping]]] = ...) -> None: ...

class BatchKeysRequest(_message.Message):
    __slots__ = ("client_id", "keys")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, client_id: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class KeyResult(_message.Message):
    __slots__ = ("key", "code", "message")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    key: str
    code: KVErrorCode
    message: str
    def __init__(self, key: _Optional[str] = ..., code: _Optional[_Union[KVErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class BatchKeysResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[KeyResult]
    def __init__(self, results: _Optional[_Iterable[_Union[KeyResult, _Mapping]]] = ...) -> None: ...

class BatchGetReplicaListRequest(_message.Message):
    __slots__ = ("client_id", "keys", "lease_ms")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    lease_ms: int
    def __init__(self, client_id: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class ReplicaListResult(_message.Message):
    __slots__ = ("key", "code", "replicas", "lease_expires_ms", "inline_data", "checksum", "lease_ms")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    key: str
    code: KVErrorCode
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    lease_expires_ms: int
    inline_data: bytes
    checksum: bytes
    lease_ms: int
    def __init__(self, key: _Optional[str] = ..., code: _Optional[_Union[KVErrorCode, str]] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., lease_expires_ms: _Optional[int] = ..., inline_data: _Optional[bytes] = ..., checksum: _Optional[bytes] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class BatchGetReplicaListResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ReplicaListResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ReplicaListResult, _Mapping]]] = ...) -> None: ...

class BatchExistsResponse(_message.Message):
    __slots__ = ("exists",)
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ...) -> None: ...

class LongestPrefixRequest(_message.Message):
    __slots__ = ("keys", "client_id", "lease_ms", "with_replicas")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    WITH_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    client_id: str
    lease_ms: int
    with_replicas: bool
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., client_id: _Optional[str] = ..., lease_ms: _Optional[int] = ..., with_replicas: _Optional[bool] = ...) -> None: ...

class LongestPrefixResponse(_message.Message):
    __slots__ = ("length", "results")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    length: int
    results: _containers.RepeatedCompositeFieldContainer[ReplicaListResult]
    def __init__(self, length: _Optional[int] = ..., results: _Optional[_Iterable[_Union[ReplicaListResult, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SegmentStats(_message.Message):
    __slots__ = ("segment_id", "node_id", "capacity", "used", "alive", "tier")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    node_id: str
    capacity: int
    used: int
    alive: bool
    tier: StorageTier
    def __init__(self, segment_id: _Optional[str] = ..., node_id: _Optional[str] = ..., capacity: _Optional[int] = ..., used: _Optional[int] = ..., alive: _Optional[bool] = ..., tier: _Optional[_Union[StorageTier, str]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("objects", "used_bytes", "capacity_bytes", "segments", "puts", "gets", "get_hits", "evictions", "removals", "prefix_queries", "prefix_hit_keys", "alive_nodes", "demotions", "promotions", "memory_evictions", "disk_capacity_bytes", "disk_used_bytes", "dropped_objects", "quarantined_fingerprints", "quarantined_misses")
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    GET_HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    REMOVALS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_KEYS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_NODES_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_MISSES_FIELD_NUMBER: _ClassVar[int]
    objects: int
    used_bytes: int
    capacity_bytes: int
    segments: _containers.RepeatedCompositeFieldContainer[SegmentStats]
    puts: int
    gets: int
    get_hits: int
    evictions: int
    removals: int
    prefix_queries: int
    prefix_hit_keys: int
    alive_nodes: int
    demotions: int
    promotions: int
    memory_evictions: int
    disk_capacity_bytes: int
    disk_used_bytes: int
    dropped_objects: int
    quarantined_fingerprints: int
    quarantined_misses: int
    def __init__(self, objects: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[SegmentStats, _Mapping]]] = ..., puts: _Optional[int] = ..., gets: _Optional[int] = ..., get_hits: _Optional[int] = ..., evictions: _Optional[int] = ..., removals: _Optional[int] = ..., prefix_queries: _Optional[int] = ..., prefix_hit_keys: _Optional[int] = ..., alive_nodes: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., memory_evictions: _Optional[int] = ..., disk_capacity_bytes: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., dropped_objects: _Optional[int] = ..., quarantined_fingerprints: _Optional[int] = ..., quarantined_misses: _Optional[int] = ...) -> None: ...

class ListNamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RootUsage(_message.Message):
    __slots__ = ("root", "objects", "bytes", "tenant")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    root: str
    objects: int
    bytes: int
    tenant: str
    def __init__(self, root: _Optional[str] = ..., objects: _Optional[int] = ..., bytes: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class FingerprintUsage(_message.Message):
    __slots__ = ("fingerprint", "labels", "roots", "objects", "bytes", "quarantined", "quarantine_reason", "quarantined_by", "quarantined_ms", "idle_ms")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ROOTS_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_REASON_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_BY_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_MS_FIELD_NUMBER: _ClassVar[int]
    IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    labels: _containers.ScalarMap[str, str]
    roots: _containers.RepeatedCompositeFieldContainer[RootUsage]
    objects: int
    bytes: int
    quarantined: bool
    quarantine_reason: str
    quarantined_by: str
    quarantined_ms: int
    idle_ms: int
    def __init__(self, fingerprint: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., roots: _Optional[_Iterable[_Union[RootUsage, _Mapping]]] = ..., objects: _Optional[int] = ..., bytes: _Optional[int] = ..., quarantined: _Optional[bool] = ..., quarantine_reason: _Optional[str] = ..., quarantined_by: _Optional[str] = ..., quarantined_ms: _Optional[int] = ..., idle_ms: _Optional[int] = ...) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("fingerprints",)
    FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    fingerprints: _containers.RepeatedCompositeFieldContainer[FingerprintUsage]
    def __init__(self, fingerprints: _Optional[_Iterable[_Union[FingerprintUsage, _Mapping]]] = ...) -> None: ...

class DropNamespacesRequest(_message.Message):
    __slots__ = ("fingerprints", "roots", "dry_run")
    FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    ROOTS_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    fingerprints: _containers.RepeatedScalarFieldContainer[str]
    roots: _containers.RepeatedScalarFieldContainer[str]
    dry_run: bool
    def __init__(self, fingerprints: _Optional[_Iterable[str]] = ..., roots: _Optional[_Iterable[str]] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class DropNamespacesResponse(_message.Message):
    __slots__ = ("dropped", "deferred")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    dropped: _containers.RepeatedCompositeFieldContainer[FingerprintUsage]
    deferred: int
    def __init__(self, dropped: _Optional[_Iterable[_Union[FingerprintUsage, _Mapping]]] = ..., deferred: _Optional[int] = ...) -> None: ...

class SetQuarantineRequest(_message.Message):
    __slots__ = ("fingerprint", "quarantined", "reason")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    quarantined: bool
    reason: str
    def __init__(self, fingerprint: _Optional[str] = ..., quarantined: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class SetQuarantineResponse(_message.Message):
    __slots__ = ("was_quarantined", "objects")
    WAS_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    was_quarantined: bool
    objects: int
    def __init__(self, was_quarantined: _Optional[bool] = ..., objects: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("type", "key", "size", "reason", "time_ms")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIME_MS_FIELD_NUMBER: _ClassVar[int]
    type: KVEventType
    key: str
    size: int
    reason: KVEventReason
    time_ms: int
    def __init__(self, type: _Optional[_Union[KVEventType, str]] = ..., key: _Optional[str] = ..., size: _Optional[int] = ..., reason: _Optional[_Union[KVEventReason, str]] = ..., time_ms: _Optional[int] = ...) -> None: ...

class SubscribeKVEventsRequest(_message.Message):
    __slots__ = ("snapshot", "from_seq")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    from_seq: int
    def __init__(self, snapshot: _Optional[bool] = ..., from_seq: _Optional[int] = ...) -> None: ...

class KVBlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "engine_block_hashes", "engine_parent_block_hash", "engine_block_size")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    medium: str
    engine_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    engine_parent_block_hash: bytes
    engine_block_size: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., medium: _Optional[str] = ..., engine_block_hashes: _Optional[_Iterable[bytes]] = ..., engine_parent_block_hash: _Optional[bytes] = ..., engine_block_size: _Optional[int] = ...) -> None: ...

class KVBlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium", "engine_block_hashes")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    engine_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ..., engine_block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVAllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVCacheEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: KVBlockStored
    removed: KVBlockRemoved
    cleared: KVAllBlocksCleared
    def __init__(self, stored: _Optional[_Union[KVBlockStored, _Mapping]] = ..., removed: _Optional[_Union[KVBlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[KVAllBlocksCleared, _Mapping]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("seq", "ts", "events", "snapshot", "snapshot_end")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_END_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ts: float
    events: _containers.RepeatedCompositeFieldContainer[KVCacheEvent]
    snapshot: bool
    snapshot_end: bool
    def __init__(self, seq: _Optional[int] = ..., ts: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KVCacheEvent, _Mapping]]] = ..., snapshot: _Optional[bool] = ..., snapshot_end: _Optional[bool] = ...) -> None: ...

class PinKeysRequest(_message.Message):
    __slots__ = ("tenant", "name", "keys")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    name: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tenant: _Optional[str] = ..., name: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class PinInfo(_message.Message):
    __slots__ = ("tenant", "name", "keys", "present", "bytes", "created_ms")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    name: str
    keys: int
    present: int
    bytes: int
    created_ms: int
    def __init__(self, tenant: _Optional[str] = ..., name: _Optional[str] = ..., keys: _Optional[int] = ..., present: _Optional[int] = ..., bytes: _Optional[int] = ..., created_ms: _Optional[int] = ...) -> None: ...

class PinKeysResponse(_message.Message):
    __slots__ = ("pin", "tenant_pinned_bytes", "memory_share_bytes")
    PIN_FIELD_NUMBER: _ClassVar[int]
    TENANT_PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SHARE_BYTES_FIELD_NUMBER: _ClassVar[int]
    pin: PinInfo
    tenant_pinned_bytes: int
    memory_share_bytes: int
    def __init__(self, pin: _Optional[_Union[PinInfo, _Mapping]] = ..., tenant_pinned_bytes: _Optional[int] = ..., memory_share_bytes: _Optional[int] = ...) -> None: ...

class UnpinKeysRequest(_message.Message):
    __slots__ = ("tenant", "name")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    name: str
    def __init__(self, tenant: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class UnpinKeysResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class ListPinsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "memory_bytes", "disk_bytes", "memory_share_bytes", "disk_share_bytes", "pinned_bytes", "evictions_over_share", "evictions_normal")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SHARE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_SHARE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_OVER_SHARE_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_NORMAL_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    memory_bytes: int
    disk_bytes: int
    memory_share_bytes: int
    disk_share_bytes: int
    pinned_bytes: int
    evictions_over_share: int
    evictions_normal: int
    def __init__(self, tenant: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., memory_share_bytes: _Optional[int] = ..., disk_share_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., evictions_over_share: _Optional[int] = ..., evictions_normal: _Optional[int] = ...) -> None: ...

class ListPinsResponse(_message.Message):
    __slots__ = ("pins", "tenants")
    PINS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    pins: _containers.RepeatedCompositeFieldContainer[PinInfo]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    def __init__(self, pins: _Optional[_Iterable[_Union[PinInfo, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ...) -> None: ...

class ControlWireRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ControlWireResponse(_message.Message):
    __slots__ = ("port", "version", "inline_max_bytes", "host")
    PORT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INLINE_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    port: int
    version: int
    inline_max_bytes: int
    host: str
    def __init__(self, port: _Optional[int] = ..., version: _Optional[int] = ..., inline_max_bytes: _Optional[int] = ..., host: _Optional[str] = ...) -> None: ...

class NodeStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatsResponse(_message.Message):
    __slots__ = ("node_id", "segments", "bytes_read", "bytes_written")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    bytes_read: int
    bytes_written: int
    def __init__(self, node_id: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ...) -> None: ...

class CopyReplicaRequest(_message.Message):
    __slots__ = ("key", "size", "source", "target")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    source: Replica
    target: Replica
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., source: _Optional[_Union[Replica, _Mapping]] = ..., target: _Optional[_Union[Replica, _Mapping]] = ...) -> None: ...

class CopyReplicaResponse(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...
