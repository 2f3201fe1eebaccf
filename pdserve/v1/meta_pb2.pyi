from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InstanceEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_EVENT_UNSPECIFIED: _ClassVar[InstanceEventType]
    INSTANCE_EVENT_JOINED: _ClassVar[InstanceEventType]
    INSTANCE_EVENT_UPDATED: _ClassVar[InstanceEventType]
    INSTANCE_EVENT_LEFT: _ClassVar[InstanceEventType]
INSTANCE_EVENT_UNSPECIFIED: InstanceEventType
INSTANCE_EVENT_JOINED: InstanceEventType
INSTANCE_EVENT_UPDATED: InstanceEventType
INSTANCE_EVENT_LEFT: InstanceEventType

class Instance(_message.Message):
    __slots__ = ("instance_id", "role", "address", "model", "max_running", "kv_capacity_bytes", "load", "labels", "lease_id", "updated_ms", "owner")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATED_MS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: _common_pb2.Role
    address: str
    model: str
    max_running: int
    kv_capacity_bytes: int
    load: _common_pb2.Load
    labels: _containers.ScalarMap[str, str]
    lease_id: str
    updated_ms: int
    owner: str
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., max_running: _Optional[int] = ..., kv_capacity_bytes: _Optional[int] = ..., load: _Optional[_Union[_common_pb2.Load, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., lease_id: _Optional[str] = ..., updated_ms: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("instance", "ttl_ms")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    instance: Instance
    ttl_ms: int
    def __init__(self, instance: _Optional[_Union[Instance, _Mapping]] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("lease_id", "ttl_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class MetaHeartbeatRequest(_message.Message):
    __slots__ = ("lease_id", "load")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    load: _common_pb2.Load
    def __init__(self, lease_id: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.Load, _Mapping]] = ...) -> None: ...

class MetaHeartbeatResponse(_message.Message):
    __slots__ = ("ttl_ms",)
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ttl_ms: int
    def __init__(self, ttl_ms: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ("role", "model", "page_size", "page_token")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    model: str
    page_size: int
    page_token: str
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ..., model: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances", "next_page_token")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    next_page_token: str
    def __init__(self, instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchInstancesRequest(_message.Message):
    __slots__ = ("role", "model", "include_existing")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_EXISTING_FIELD_NUMBER: _ClassVar[int]
    role: _common_pb2.Role
    model: str
    include_existing: bool
    def __init__(self, role: _Optional[_Union[_common_pb2.Role, str]] = ..., model: _Optional[str] = ..., include_existing: _Optional[bool] = ...) -> None: ...

class InstanceEvent(_message.Message):
    __slots__ = ("type", "instance")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    type: InstanceEventType
    instance: Instance
    def __init__(self, type: _Optional[_Union[InstanceEventType, str]] = ..., instance: _Optional[_Union[Instance, _Mapping]] = ...) -> None: ...
