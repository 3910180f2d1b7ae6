from loraserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "adapter", "adapter_version", "sampling", "max_new_tokens", "stop_token_ids", "deadline_unix", "reply_to", "arrival_unix", "output_ids", "adapter_sha256", "attempt", "tenant", "ttft_slo_s", "adapter_rank", "tokens_per_minute", "prefill_group", "cache_salt", "sampling_params", "trace_context", "request_key", "request_cost", "spec")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SHA256_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_S_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_RANK_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_MINUTE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_GROUP_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_COST_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter: str
    adapter_version: int
    sampling: _common_pb2.SamplingParameters
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    deadline_unix: float
    reply_to: str
    arrival_unix: float
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter_sha256: str
    attempt: int
    tenant: str
    ttft_slo_s: float
    adapter_rank: int
    tokens_per_minute: int
    prefill_group: str
    cache_salt: str
    sampling_params: bytes
    trace_context: _containers.ScalarMap[str, str]
    request_key: str
    request_cost: int
    spec: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., adapter: _Optional[str] = ..., adapter_version: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParameters, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., deadline_unix: _Optional[float] = ..., reply_to: _Optional[str] = ..., arrival_unix: _Optional[float] = ..., output_ids: _Optional[_Iterable[int]] = ..., adapter_sha256: _Optional[str] = ..., attempt: _Optional[int] = ..., tenant: _Optional[str] = ..., ttft_slo_s: _Optional[float] = ..., adapter_rank: _Optional[int] = ..., tokens_per_minute: _Optional[int] = ..., prefill_group: _Optional[str] = ..., cache_salt: _Optional[str] = ..., sampling_params: _Optional[bytes] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., request_key: _Optional[str] = ..., request_cost: _Optional[int] = ..., spec: _Optional[bytes] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("queue_position", "instance")
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    queue_position: int
    instance: str
    def __init__(self, queue_position: _Optional[int] = ..., instance: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetClusterStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerState(_message.Message):
    __slots__ = ("worker_id", "ready", "running", "waiting", "max_batch_size", "free_pages", "total_pages", "kv_pages", "adapter_pages", "resident_adapters", "last_report_age_s", "prefetch_hits", "prefetch_misses", "steps", "pool_waste_fraction", "draining")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_MISSES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    POOL_WASTE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    ready: bool
    running: int
    waiting: int
    max_batch_size: int
    free_pages: int
    total_pages: int
    kv_pages: int
    adapter_pages: int
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    last_report_age_s: float
    prefetch_hits: int
    prefetch_misses: int
    steps: int
    pool_waste_fraction: float
    draining: bool
    def __init__(self, worker_id: _Optional[str] = ..., ready: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., kv_pages: _Optional[int] = ..., adapter_pages: _Optional[int] = ..., resident_adapters: _Optional[_Iterable[str]] = ..., last_report_age_s: _Optional[float] = ..., prefetch_hits: _Optional[int] = ..., prefetch_misses: _Optional[int] = ..., steps: _Optional[int] = ..., pool_waste_fraction: _Optional[float] = ..., draining: _Optional[bool] = ...) -> None: ...

class ClusterState(_message.Message):
    __slots__ = ("workers", "queue_length", "max_queue_length", "instance")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerState]
    queue_length: int
    max_queue_length: int
    instance: str
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerState, _Mapping]]] = ..., queue_length: _Optional[int] = ..., max_queue_length: _Optional[int] = ..., instance: _Optional[str] = ...) -> None: ...

class PrepareAdapterRequest(_message.Message):
    __slots__ = ("adapter", "adapter_version", "adapter_sha256", "adapter_rank", "tenant", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SHA256_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_RANK_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    adapter_version: int
    adapter_sha256: str
    adapter_rank: int
    tenant: str
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, adapter: _Optional[str] = ..., adapter_version: _Optional[int] = ..., adapter_sha256: _Optional[str] = ..., adapter_rank: _Optional[int] = ..., tenant: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SubmitStreamRequest(_message.Message):
    __slots__ = ("requests", "hints")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[SubmitRequest]
    hints: _containers.RepeatedCompositeFieldContainer[PrepareAdapterRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[SubmitRequest, _Mapping]]] = ..., hints: _Optional[_Iterable[_Union[PrepareAdapterRequest, _Mapping]]] = ...) -> None: ...

class SubmitStreamResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[SubmitOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[SubmitOutcome, _Mapping]]] = ...) -> None: ...

class SubmitOutcome(_message.Message):
    __slots__ = ("request_id", "status", "message", "queued", "retry_after_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: str
    message: str
    queued: SubmitResponse
    retry_after_ms: int
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[str] = ..., message: _Optional[str] = ..., queued: _Optional[_Union[SubmitResponse, _Mapping]] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class PrepareAdapterResponse(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...
