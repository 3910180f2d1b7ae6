"""The ZMQ wire format between roles: typed msgpack messages, bulk bytes in frames of their own.

A message is a multipart ZMQ message:

    frame 0: one byte, the message type (MsgType)
    frame 1: msgpack map of the message's fields
    frame 2...: raw buffers (adapter files), sent and received without copies

Decoding rejects unknown types, malformed maps, missing fields and wrong field types with a
WireError. Nothing is ever pickled: a peer can send only data.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack


class WireError(ValueError):
    """A frame sequence that is not a valid loraserve message."""


class MsgType(enum.IntEnum):
    WORKER_REPORT = 1  # worker -> scheduler: state after a step, or a heartbeat
    ASSIGN = 2  # scheduler -> worker: run this request
    CANCEL = 3  # scheduler -> worker: stop these requests
    PREFETCH = 4  # scheduler -> worker: adapters it will likely need next
    TOKENS = 5  # worker (or scheduler, for failures) -> gateway: new tokens, maybe the end
    FETCH_ADAPTER = 6  # worker -> adapter store: send me this adapter version
    ADAPTER = 7  # adapter store -> worker: the adapter's files (2 raw frames)
    FETCH_FAILED = 8  # adapter store -> worker: could not serve a fetch


@dataclass
class Message:
    TYPE: ClassVar[MsgType]


@dataclass
class WorkerReport(Message):
    TYPE: ClassVar[MsgType] = MsgType.WORKER_REPORT
    worker_id: str
    ready: bool
    max_batch_size: int
    total_pages: int
    free_pages: int
    kv_pages: int
    adapter_pages: int
    running: list[str]  # request ids in the running batch
    waiting: list[str]  # request ids assigned but not yet running
    resident: list[list]  # [[adapter name, version], ...]
    finished: list[str] = field(default_factory=list)  # request ids that ended since the last report
    evictable_pages: int = 0  # pages of cached adapters no request uses (reclaimable for KV)
    tokens_per_page: int = 16
    steps: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    waste_fraction: float = 0.0
    fatal: str | None = None  # set on the last report of a worker that is dying


@dataclass
class Assign(Message):
    TYPE: ClassVar[MsgType] = MsgType.ASSIGN
    request_id: str
    prompt_ids: list[int]
    adapter: str | None
    adapter_version: int
    sampling: dict  # SamplingParams fields
    reply_to: str  # the gateway's token sink
    arrival: float  # unix seconds at the gateway
    deadline: float | None = None  # unix seconds
    queued_s: float = 0.0  # time spent in the scheduler's queue
    trace: dict[str, str] = field(default_factory=dict)  # W3C trace context carrier


@dataclass
class Cancel(Message):
    TYPE: ClassVar[MsgType] = MsgType.CANCEL
    request_ids: list[str]
    reason: str = ""


@dataclass
class Prefetch(Message):
    TYPE: ClassVar[MsgType] = MsgType.PREFETCH
    adapters: list[list]  # [[name, version], ...], most urgent first


@dataclass
class Tokens(Message):
    TYPE: ClassVar[MsgType] = MsgType.TOKENS
    request_id: str
    token_ids: list[int]
    worker_id: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" when finished normally
    error_status: str | None = None  # a grpc.StatusCode name when it failed
    error: str | None = None
    timings: dict = field(default_factory=dict)  # worker-side: queue_s, adapter_load_s, prefill_s, decode_s


@dataclass
class FetchAdapter(Message):
    TYPE: ClassVar[MsgType] = MsgType.FETCH_ADAPTER
    name: str
    version: int
    trace: dict[str, str] = field(default_factory=dict)


@dataclass
class AdapterFiles(Message):
    """Header in the map; the files' bytes in frames 2 (adapter_config.json) and 3 (weights)."""

    TYPE: ClassVar[MsgType] = MsgType.ADAPTER
    name: str
    version: int
    weights_format: str  # "safetensors"
    config_json: bytes | memoryview = b""  # carried as a raw frame
    weights: bytes | memoryview = b""  # carried as a raw frame
    BUFFERS: ClassVar[tuple[str, ...]] = ("config_json", "weights")


@dataclass
class FetchFailed(Message):
    TYPE: ClassVar[MsgType] = MsgType.FETCH_FAILED
    name: str
    version: int
    status: str  # a grpc.StatusCode name
    error: str


_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls for cls in (WorkerReport, Assign, Cancel, Prefetch, Tokens, FetchAdapter, AdapterFiles, FetchFailed)
}


def encode(message: Message) -> list[bytes | memoryview]:
    """Frames for `message`; send with send_multipart(frames, copy=False) to avoid copying buffers."""
    buffers = getattr(message, "BUFFERS", ())
    body = {name: getattr(message, name) for name, _, _ in _fields(type(message)) if name not in buffers}
    return [
        bytes([message.TYPE]),
        msgpack.packb(body, use_bin_type=True),
        *(getattr(message, b) for b in buffers),
    ]


def decode(frames: list) -> Message:
    """Parse frames (bytes, or zmq.Frame when received with copy=False) into a message."""
    if len(frames) < 2:
        raise WireError(f"a message needs at least 2 frames, got {len(frames)}")
    kind = bytes(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0])
    if len(kind) != 1 or kind[0] not in _TYPES:
        raise WireError(f"unknown message type {kind!r}")
    cls = _TYPES[kind[0]]
    try:
        body = msgpack.unpackb(_bytes(frames[1]), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise WireError(f"{cls.__name__}: body is not msgpack: {e}") from None
    if not isinstance(body, dict):
        raise WireError(f"{cls.__name__}: body must be a map")
    buffers = getattr(cls, "BUFFERS", ())
    if len(frames) != 2 + len(buffers):
        raise WireError(f"{cls.__name__}: expected {2 + len(buffers)} frames, got {len(frames)}")
    for name, frame in zip(buffers, frames[2:], strict=True):
        body[name] = frame.buffer if hasattr(frame, "buffer") else frame
    return _build(cls, body)


def _bytes(frame) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


@functools.cache
def _fields(cls: type[Message]) -> tuple[tuple[str, Any, bool], ...]:
    """(name, type hint, required) of every field; resolved once per message class."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f.name, hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
    )


def _build(cls: type[Message], body: dict[str, Any]) -> Message:
    values = {}
    for name, hint, required in _fields(cls):
        if name not in body:
            if required:
                raise WireError(f"{cls.__name__}: missing field {name!r}")
            continue
        value = body[name]
        if not _matches(value, hint):
            raise WireError(f"{cls.__name__}.{name}: unexpected {type(value).__name__} value")
        values[name] = value
    return cls(**values)


def _matches(value: Any, hint: Any) -> bool:  # noqa: PLR0911 - one return per kind of type hint
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is memoryview:
        return isinstance(value, memoryview)
    base = origin or hint
    if not isinstance(value, base):
        return False
    if origin is dict and typing.get_args(hint):  # parametrized maps are checked item by item
        key_type, value_type = typing.get_args(hint)
        return all(_matches(k, key_type) and _matches(v, value_type) for k, v in value.items())
    return True
