from loraserve.v1 import common_pb2 as _common_pb2
from loraserve.v1 import gateway_pb2 as _gateway_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WatchAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdapterChange(_message.Message):
    __slots__ = ("name", "version", "sha256", "deleted", "synced", "rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    sha256: str
    deleted: bool
    synced: bool
    rank: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., sha256: _Optional[str] = ..., deleted: _Optional[bool] = ..., synced: _Optional[bool] = ..., rank: _Optional[int] = ...) -> None: ...

class GetStoreStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreState(_message.Message):
    __slots__ = ("adapters", "used_bytes", "budget_bytes", "max_adapter_bytes", "data_address", "retired_versions", "retired_bytes")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RETIRED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    RETIRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    adapters: int
    used_bytes: int
    budget_bytes: int
    max_adapter_bytes: int
    data_address: str
    retired_versions: int
    retired_bytes: int
    def __init__(self, adapters: _Optional[int] = ..., used_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., max_adapter_bytes: _Optional[int] = ..., data_address: _Optional[str] = ..., retired_versions: _Optional[int] = ..., retired_bytes: _Optional[int] = ...) -> None: ...
