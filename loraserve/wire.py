"""The ZMQ wire format between roles: typed msgpack messages, bulk bytes in frames of their own.

A message is a multipart ZMQ message:

    frame 0: one byte, the message type (MsgType)
    frame 1: msgpack map of the message's fields
    frame 2...: raw buffers (adapter files), sent and received without copies

Every field's type hint is its schema, and `decode` checks a message against it completely
before any role sees it: element types of lists and maps, the shape of tuples, string and list
lengths, numeric ranges (`Limit`), finite floats, endpoint addresses, the keys of sampling maps,
and per-message invariants (`Message.check`). Anything else — an unknown type, a field too many
or missing, a wrong type anywhere inside — is a WireError, the only exception `decode` raises.
Roles log it (rate-limited, `loraserve/log_limit.py`) and drop the message: a peer can make a
role ignore a message, never crash or corrupt it. Nothing is ever pickled: a peer sends only data.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, NamedTuple

import msgpack

from loraserve.endpoints import BadEndpointError, check_endpoint
from loraserve.params import MAX_LOGPROBS, SamplingParams
from loraserve.prefix_keys import FINGERPRINT_BYTES
from loraserve.structured import MAX_GRAMMAR_BYTES


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
    STEP_TOKENS = 9  # worker -> gateway: one step's new tokens for all of this gateway's requests
    ADAPTER_ROWS = 10  # adapter store -> worker: the adapter packed in the pool's row layout (`pool_rows.py`)


# ---- the schema vocabulary --------------------------------------------------------------------
@dataclass(frozen=True)
class Limit:
    """Bounds beyond a field's type: a number in [lo, hi]; a string, list or map at most max_len long."""

    lo: float | None = None
    hi: float | None = None
    max_len: int | None = None


@dataclass(frozen=True)
class Keys:
    """A map whose keys must all be among `allowed` (a map splatted into a constructor later)."""

    allowed: frozenset[str]


class EndpointForm:
    """A string that must be a connectable tcp:// or ipc:// endpoint (`loraserve/endpoints.py`)."""


# Defaults where a hint sets no Limit: nothing on the wire is unbounded.
MAX_TEXT = 64 * 1024  # characters of an error message or reason
MAX_LIST = 1 << 20  # elements of any list (a 1M-token prompt)
INT64 = Limit(-(2**63), 2**63 - 1)

MAX_ID = 256  # request ids, worker ids, adapter names
MAX_IDS = 1 << 16  # request ids in one cancel or step message
# A worker's report is read by the scheduler after every step of every worker, so its lists are
# bounded by what a real worker holds: the scheduler never gives a worker more than its batch
# size (at most MAX_BATCH), and a worker names at most MAX_RESIDENT of its resident adapters
# (its most recently used ones). A report beyond these is refused, not trimmed.
MAX_BATCH = 1024  # a worker's max_batch_size (vLLM's default is 256, ours 64)
MAX_REPORTED_IDS = 2 * MAX_BATCH  # request ids in one list of a report (running, waiting, finished)
MAX_RESIDENT = 4096  # resident adapters named in one report
MAX_PREFETCH = 1024  # adapters in one prefetch hint
MAX_STEP_SAMPLES = 64  # measured steps in one report
MAX_PREFIXES = 4096  # cached prefix fingerprints in one report (its most recently used)
MAX_ROW_LAYERS = 1024  # layers of an adapter's packed rows (`loraserve/pool_rows.py`)

Id = Annotated[str, Limit(max_len=MAX_ID)]
Text = Annotated[str, Limit(max_len=MAX_TEXT)]
Count = Annotated[int, Limit(0, 2**63 - 1)]
TokenId = Annotated[int, Limit(0, 2**32 - 1)]
Version = Annotated[int, Limit(0, 2**32 - 1)]  # uint32 in the protos
Seconds = float  # finite, any sign (clocks of two hosts may disagree a little)
AdapterRef = tuple[Id, Version]  # (name, version) on the wire
AdapterKey = tuple[str, int]  # (name, version) in every role: an adapter version's one name
Ids = Annotated[list[Id], Limit(max_len=MAX_IDS)]
ReportedIds = Annotated[list[Id], Limit(max_len=MAX_REPORTED_IDS)]
Probability = Annotated[float, Limit(0.0, 1.0)]
StepSample = tuple[Count, Count, Count, Count, Annotated[float, Limit(0.0, 3600.0)]]
TraceCarrier = Annotated[dict[Id, Annotated[str, Limit(max_len=1024)]], Limit(max_len=16)]  # W3C trace context
Endpoint = Annotated[str, EndpointForm()]
# A token's log-probability, then the ids and log-probabilities of the most likely tokens at its position.
Logprob = tuple[
    float,
    Annotated[list[TokenId], Limit(max_len=MAX_LOGPROBS)],
    Annotated[list[float], Limit(max_len=MAX_LOGPROBS)],
]


class TokenLogprob(NamedTuple):
    """A `Logprob` in every role: packed as the tuple it is, decoded as a tuple (`TokenLogprob(*t)`)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


SamplingMap = Annotated[
    dict[
        str,
        bool
        | int
        | float
        | Annotated[list[TokenId], Limit(max_len=1024)]
        | Annotated[str, Limit(max_len=MAX_GRAMMAR_BYTES)]
        | None,
    ],
    Keys(frozenset(f.name for f in dataclasses.fields(SamplingParams))),
]


@dataclass
class Message:
    TYPE: ClassVar[MsgType]

    def check(self) -> None:
        """Invariants across fields, run by `decode` after every field matched its hint."""


# ---- the messages -----------------------------------------------------------------------------
@dataclass
class WorkerReport(Message):
    TYPE: ClassVar[MsgType] = MsgType.WORKER_REPORT
    worker_id: Id
    ready: bool
    max_batch_size: Annotated[int, Limit(0, MAX_BATCH)]
    total_pages: Count
    free_pages: Count
    kv_pages: Count
    adapter_pages: Count
    running: ReportedIds  # request ids in the running batch
    waiting: ReportedIds  # request ids assigned but not yet running
    # [(adapter name, version), ...], least recently used first; the most recent MAX_RESIDENT at most
    resident: Annotated[list[AdapterRef], Limit(max_len=MAX_RESIDENT)]
    finished: ReportedIds = field(default_factory=list)  # request ids that ended since the last report
    evictable_pages: Count = 0  # pages of cached adapters no request uses, and idle cached KV pages (reclaimable)
    cached_pages: Count = 0  # idle KV pages kept for the prefix cache (among evictable_pages)
    tokens_per_page: Annotated[int, Limit(1, 1 << 20)] = 16
    steps: Count = 0
    prefetch_hits: Count = 0
    prefetch_misses: Count = 0
    waste_fraction: Annotated[float, Limit(0.0, 1.0)] = 0.0
    fatal: Text | None = None  # set on the last report of a worker that is dying
    instance: Annotated[str, Limit(max_len=64)] = ""  # random per worker process: a new one means it restarted
    draining: bool = False  # SIGTERM: finishing what it holds, taking nothing new
    # Steps measured since the last report, for the scheduler's step-cost model (scheduler/cost_model.py):
    # (tokens computed, Σ adapter rank over those tokens, distinct adapters, KV pages read, seconds).
    step_samples: Annotated[list[StepSample], Limit(max_len=MAX_STEP_SAMPLES)] = field(default_factory=list)
    # Prefix caching: fingerprints of the prefixes cached here (`loraserve/prefix_keys.py`), 16 bytes
    # each, concatenated, most recently used first, at most MAX_PREFIXES; None: as in the last report.
    cached_prefixes: bytes | None = None

    def check(self) -> None:
        for name in ("free_pages", "kv_pages", "adapter_pages", "evictable_pages", "cached_pages"):
            if getattr(self, name) > self.total_pages:
                raise WireError(f"WorkerReport.{name}: more than total_pages ({self.total_pages})")
        prefixes = self.cached_prefixes
        if prefixes is not None and (
            len(prefixes) % FINGERPRINT_BYTES or len(prefixes) > MAX_PREFIXES * FINGERPRINT_BYTES
        ):
            raise WireError(
                f"WorkerReport.cached_prefixes: must be at most {MAX_PREFIXES} fingerprints "
                f"of {FINGERPRINT_BYTES} bytes each"
            )

    def prefixes(self) -> list[bytes]:
        """`cached_prefixes` as one fingerprint each (empty when None)."""
        blob = self.cached_prefixes or b""
        return [blob[i : i + FINGERPRINT_BYTES] for i in range(0, len(blob), FINGERPRINT_BYTES)]


@dataclass
class Assign(Message):
    TYPE: ClassVar[MsgType] = MsgType.ASSIGN
    request_id: Id
    prompt_ids: list[TokenId]
    adapter: Id | None
    adapter_version: Version
    sampling: SamplingMap  # SamplingParams fields
    reply_to: Endpoint  # the gateway's token sink
    arrival: Seconds  # unix seconds at the gateway
    deadline: Seconds | None = None  # unix seconds
    queued_s: Seconds = 0.0  # time spent in the scheduler's queue
    trace: TraceCarrier = field(default_factory=dict)  # W3C trace context carrier
    # Tokens an earlier attempt generated and streamed (failover): recomputed with the prompt, then continued.
    output_ids: list[TokenId] = field(default_factory=list)
    adapter_sha256: Annotated[str, Limit(max_len=64)] = ""  # of the weights file; "" for the base model
    group: Id | None = None  # shared prefill with the group's requests of the same prompt (`step_scheduler`)
    cache_salt: Id = ""  # prefix caching: only requests with the same salt share cached KV

    def check(self) -> None:
        if len(self.prompt_ids) + len(self.output_ids) > MAX_LIST:
            raise WireError(f"Assign: prompt_ids + output_ids hold more than {MAX_LIST} tokens")


@dataclass
class Cancel(Message):
    TYPE: ClassVar[MsgType] = MsgType.CANCEL
    request_ids: Ids
    reason: Text = ""


@dataclass
class Prefetch(Message):
    TYPE: ClassVar[MsgType] = MsgType.PREFETCH
    adapters: Annotated[list[AdapterRef], Limit(max_len=MAX_PREFETCH)]  # [(name, version), ...], most urgent first
    # scores[i]: the predicted likelihood that adapters[i] is needed on this worker soon. The worker
    # remembers the latest score of each adapter, and a prefetch evicts only adapters scored lower
    # than the one it fetches. Empty: unknown, each counts as UNKNOWN_SCORE (see worker/unified_pool.py).
    scores: Annotated[list[Probability], Limit(max_len=MAX_PREFETCH)] = field(default_factory=list)
    # A gateway's hint for one request (`scheduler/hints.py`): that request's trace, which the fetch joins.
    trace: TraceCarrier = field(default_factory=dict)

    def check(self) -> None:
        if self.scores and len(self.scores) != len(self.adapters):
            raise WireError("Prefetch: scores and adapters differ in length")


@dataclass
class Tokens(Message):
    TYPE: ClassVar[MsgType] = MsgType.TOKENS
    request_id: Id
    token_ids: list[TokenId]
    worker_id: Id = ""
    finished: bool = False
    finish_reason: Annotated[str, Limit(max_len=32)] | None = None  # "stop" | "length" when finished normally
    error_status: Annotated[str, Limit(max_len=32)] | None = None  # a grpc.StatusCode name when it failed
    error: Text | None = None
    # With error_status UNAVAILABLE: the request did not fail by itself, its worker was lost (killed,
    # stopped, drained past its timeout); the gateway may resubmit it with the tokens it streamed.
    retry: bool = False
    # worker-side: queue_s, adapter_load_s, prefill_s, decode_s, ...
    timings: Annotated[dict[Id, Seconds], Limit(max_len=32)] = field(default_factory=dict)
    # With sampling logprobs: one per token of token_ids. With prompt_logprobs, on the message that
    # brings the first token: one per prompt token after the first.
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    cached_tokens: Count = 0  # with its first token, and on the message that ends it: prompt tokens found cached

    def check(self) -> None:
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise WireError("Tokens: logprobs and token_ids differ in length")
        _check_top_lengths(self.logprobs, self.prompt_logprobs)


@dataclass
class StepTokens(Message):
    """One engine step's new tokens for every running request of one gateway: one message per
    gateway per step instead of one per request. Ends no request (a last token and the finish
    reason travel in a `Tokens` of their own)."""

    TYPE: ClassVar[MsgType] = MsgType.STEP_TOKENS
    worker_id: Id
    request_ids: Ids
    token_ids: Annotated[list[list[TokenId]], Limit(max_len=MAX_IDS)]  # token_ids[i] belong to request_ids[i]
    # Empty when no request of the step asked for them; else one list per request, as in `Tokens`.
    logprobs: Annotated[list[list[Logprob]], Limit(max_len=MAX_IDS)] = field(default_factory=list)
    prompt_logprobs: Annotated[list[list[Logprob]], Limit(max_len=MAX_IDS)] = field(default_factory=list)
    # Empty when no request of the step reports cached prompt tokens; else one count per request.
    cached_tokens: Annotated[list[Count], Limit(max_len=MAX_IDS)] = field(default_factory=list)

    def check(self) -> None:
        if len(self.request_ids) != len(self.token_ids):
            raise WireError("StepTokens: request_ids and token_ids differ in length")
        for name in ("logprobs", "prompt_logprobs", "cached_tokens"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.request_ids):
                raise WireError(f"StepTokens: request_ids and {name} differ in length")
        for i, (logprobs, token_ids) in enumerate(zip(self.logprobs, self.token_ids)):  # noqa: B905 (may be empty)
            if logprobs and len(logprobs) != len(token_ids):
                raise WireError(f"StepTokens: logprobs[{i}] and token_ids[{i}] differ in length")
        _check_top_lengths(*self.logprobs, *self.prompt_logprobs)

    def split(self) -> list[Tokens]:
        """The same news as one `Tokens` per request."""
        n = len(self.request_ids)
        logprobs, prompt_logprobs = self.logprobs or [[]] * n, self.prompt_logprobs or [[]] * n
        cached = self.cached_tokens or [0] * n
        return [
            Tokens(r, t, self.worker_id, logprobs=lp, prompt_logprobs=plp, cached_tokens=c)
            for r, t, lp, plp, c in zip(
                self.request_ids, self.token_ids, logprobs, prompt_logprobs, cached, strict=True
            )
        ]


def _check_top_lengths(*lists: list[Logprob]) -> None:
    for entries in lists:
        for _, top_ids, top_logprobs in entries:
            if len(top_ids) != len(top_logprobs):
                raise WireError("a logprob's top_ids and top_logprobs differ in length")


@dataclass
class FetchAdapter(Message):
    TYPE: ClassVar[MsgType] = MsgType.FETCH_ADAPTER
    name: Id
    version: Version
    trace: TraceCarrier = field(default_factory=dict)
    # Rows: ask for the adapter packed in the pool's row layout of a model of this shape (an AdapterRows
    # reply; a store without rows, or for another shape, answers with the files). 0: the files.
    row_width: Annotated[int, Limit(0, 1 << 20)] = 0
    num_layers: Annotated[int, Limit(0, MAX_ROW_LAYERS)] = 0
    shared_memory: bool = False  # the worker can map the store's shared-memory files (same host, same user)


@dataclass
class AdapterPayload(Message):
    """Header in the map; the files' bytes in frames 2 (adapter_config.json) and 3 (weights)."""

    TYPE: ClassVar[MsgType] = MsgType.ADAPTER
    name: Id
    version: Version
    weights_format: Annotated[str, Limit(max_len=32)]  # "safetensors"
    config_json: bytes | memoryview = b""  # carried as a raw frame
    weights: bytes | memoryview = b""  # carried as a raw frame
    sha256: Annotated[str, Limit(max_len=64)] = ""  # hex SHA-256 of `weights`; the fetcher refuses bytes that differ
    BUFFERS: ClassVar[tuple[str, ...]] = ("config_json", "weights")


@dataclass
class AdapterRows(Message):
    """An adapter version packed in the pool's row layout (`loraserve/pool_rows.py`): the header in the map,
    adapter_config.json in frame 2, the rows in frame 3 — or, with `shm_name`, an empty frame 3 and the rows
    in the store's shared-memory file of that name, whose header carries `shm_token`."""

    TYPE: ClassVar[MsgType] = MsgType.ADAPTER_ROWS
    name: Id
    version: Version
    sha256: Annotated[str, Limit(max_len=64)]  # of the weights file the rows were packed from (its identity)
    rank: Annotated[int, Limit(1, 1 << 16)]
    modules: Annotated[list[Annotated[str, Limit(max_len=16)]], Limit(max_len=8)]  # targeted, LORA_MODULES order
    layers: Annotated[list[Annotated[int, Limit(0, MAX_ROW_LAYERS - 1)]], Limit(max_len=MAX_ROW_LAYERS)]  # with weights
    dtype: Annotated[str, Limit(max_len=16)]  # "float16" | "bfloat16" | "float32" | "float64"
    num_layers: Annotated[int, Limit(1, MAX_ROW_LAYERS)]
    num_rows: Annotated[int, Limit(1, 1 << 24)]
    row_width: Annotated[int, Limit(1, 1 << 20)]
    digests: Annotated[list[Annotated[str, Limit(max_len=64)]], Limit(max_len=MAX_ROW_LAYERS)]  # sha256 per layer
    shm_name: Annotated[str, Limit(max_len=128)] = ""  # "": the rows are in frame 3
    shm_token: Annotated[str, Limit(max_len=64)] = ""
    config_json: bytes | memoryview = b""  # carried as a raw frame
    rows: bytes | memoryview = b""  # carried as a raw frame
    BUFFERS: ClassVar[tuple[str, ...]] = ("config_json", "rows")

    def check(self) -> None:
        if len(self.digests) != self.num_layers:
            raise WireError("AdapterRows: digests and num_layers differ")
        if bool(self.shm_name) != bool(self.shm_token):
            raise WireError("AdapterRows: shm_name and shm_token go together")


@dataclass
class FetchFailed(Message):
    TYPE: ClassVar[MsgType] = MsgType.FETCH_FAILED
    name: Id
    version: Version
    status: Annotated[str, Limit(max_len=32)]  # a grpc.StatusCode name
    error: Text


_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        WorkerReport,
        Assign,
        Cancel,
        Prefetch,
        Tokens,
        FetchAdapter,
        AdapterPayload,
        FetchFailed,
        StepTokens,
        AdapterRows,
    )
}


# ---- encoding and decoding --------------------------------------------------------------------
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
    """Parse frames (bytes, or zmq.Frame when received with copy=False) into a checked message.

    Raises WireError, and nothing else, for anything that is not a valid message.
    """
    if not isinstance(frames, list | tuple) or len(frames) < 2:
        raise WireError(f"a message needs at least 2 frames, got {len(frames) if isinstance(frames, list) else '?'}")
    kind = _bytes(frames[0])
    if len(kind) != 1 or kind[0] not in _TYPES:
        raise WireError(f"unknown message type {kind[:8]!r}")
    cls = _TYPES[kind[0]]
    buffers = getattr(cls, "BUFFERS", ())
    if len(frames) != 2 + len(buffers):
        raise WireError(f"{cls.__name__}: expected {2 + len(buffers)} frames, got {len(frames)}")
    try:
        body = msgpack.unpackb(_bytes(frames[1]), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise WireError(f"{cls.__name__}: body is not msgpack: {type(e).__name__}") from None
    if not isinstance(body, dict):
        raise WireError(f"{cls.__name__}: body must be a map")
    if any(name in body for name in buffers):
        raise WireError(f"{cls.__name__}: buffers travel as frames, not in the map")
    for name, frame in zip(buffers, frames[2:], strict=True):
        body[name] = frame.buffer if hasattr(frame, "buffer") else frame
    return _build(cls, body)


def _bytes(frame: Any) -> bytes:
    if hasattr(frame, "bytes"):
        return frame.bytes
    if isinstance(frame, bytes | bytearray | memoryview):
        return bytes(frame)
    raise WireError(f"a frame must be bytes, got {type(frame).__name__}")


@functools.cache
def _fields(cls: type[Message]) -> tuple[tuple[str, Any, bool], ...]:
    """(name, type hint, required) of every field; resolved once per message class."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return tuple(
        (f.name, hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(cls)
    )


def _build(cls: type[Message], body: dict[str, Any]) -> Message:
    fields = _fields(cls)
    unknown = body.keys() - {name for name, _, _ in fields}
    if unknown:
        raise WireError(f"{cls.__name__}: unknown field {str(sorted(map(str, unknown))[0])[:64]!r}")
    values = {}
    for name, hint, required in fields:
        if name in body:
            values[name] = _check(body[name], hint, f"{cls.__name__}.{name}")
        elif required:
            raise WireError(f"{cls.__name__}: missing field {name!r}")
    message = cls(**values)
    message.check()
    return message


def _check(value: Any, hint: Any, where: str) -> Any:
    """`value` as the field will hold it (lists become tuples where the hint says tuple), or WireError."""
    constraints: tuple[Any, ...] = ()
    if typing.get_origin(hint) is Annotated:
        hint, *extra = typing.get_args(hint)
        constraints = tuple(extra)
    for constraint in constraints:  # a list too long is refused before any of its items is looked at
        if isinstance(constraint, Limit) and isinstance(value, list | tuple | dict | str):
            _within(value, constraint, where)
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return _check_union(value, hint, constraints, where)
    checker = _CHECKERS.get(origin or hint)
    if checker is None:
        raise TypeError(f"{where}: no wire check for {hint!r}")  # a bug in a message class, not in a peer
    value = checker(value, hint, where)
    for constraint in constraints:
        _apply(constraint, value, where)
    return value


def _check_union(value: Any, hint: Any, constraints: tuple[Any, ...], where: str) -> Any:
    for arm in typing.get_args(hint):
        try:
            checked = _check(value, arm, where)
        except WireError:
            continue
        for constraint in constraints:
            _apply(constraint, checked, where)
        return checked
    raise WireError(f"{where}: unexpected {type(value).__name__} value")


def _apply(constraint: Any, value: Any, where: str) -> None:
    if isinstance(constraint, Limit):
        _within(value, constraint, where)
    elif isinstance(constraint, Keys):
        stray = next((k for k in value if k not in constraint.allowed), None)
        if stray is not None:
            raise WireError(f"{where}: unknown key {stray[:64]!r}")
    elif isinstance(constraint, EndpointForm):
        try:
            check_endpoint(value)
        except BadEndpointError as e:
            raise WireError(f"{where}: {e}") from None


def _within(value: Any, limit: Limit, where: str) -> None:
    if isinstance(value, str | list | tuple | dict):
        if limit.max_len is not None and len(value) > limit.max_len:
            raise WireError(f"{where}: longer than {limit.max_len} (got {len(value)})")
        return
    if (limit.lo is not None and value < limit.lo) or (limit.hi is not None and value > limit.hi):
        raise WireError(f"{where}: {value!r} is outside [{limit.lo}, {limit.hi}]")


def _expect(value: Any, kinds: type | tuple[type, ...], where: str) -> None:
    if not isinstance(value, kinds):
        raise WireError(f"{where}: unexpected {type(value).__name__} value")


def _check_none(value: Any, hint: Any, where: str) -> None:
    if value is not None:
        raise WireError(f"{where}: unexpected {type(value).__name__} value")


def _check_bool(value: Any, hint: Any, where: str) -> bool:
    _expect(value, bool, where)
    return value


def _check_int(value: Any, hint: Any, where: str) -> int:
    if isinstance(value, bool):
        raise WireError(f"{where}: unexpected bool value")
    _expect(value, int, where)
    _within(value, INT64, where)
    return value


def _check_float(value: Any, hint: Any, where: str) -> float:
    if isinstance(value, bool):
        raise WireError(f"{where}: unexpected bool value")
    _expect(value, int | float, where)
    value = float(value)  # msgpack ints fit a float's range (|x| < 2**64)
    if not math.isfinite(value):
        raise WireError(f"{where}: not a finite number")
    return value


def _check_str(value: Any, hint: Any, where: str) -> str:
    _expect(value, str, where)
    _within(value, Limit(max_len=MAX_TEXT), where)
    return value


def _check_buffer(value: Any, hint: Any, where: str) -> Any:
    _expect(value, hint, where)
    return value


def _check_list(value: Any, hint: Any, where: str) -> list:
    _expect(value, list, where)
    _within(value, Limit(max_len=MAX_LIST), where)
    (item,) = typing.get_args(hint) or (Any,)
    fast = _fast_check(item)
    if fast is not None:  # the common case of a long list of ids or (name, version) pairs
        checked = list(map(fast, value))
        if _MISMATCH not in checked:
            return checked
    return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]


_MISMATCH = object()  # what a fast check returns for a value it does not accept


@functools.cache
def _fast_check(hint: Any) -> Callable[[Any], Any] | None:
    """A quick version of `_check` for the simple hints that fill long lists (bounded strings and
    ints, and fixed tuples of them): returns the value as `_check` would, or `_MISMATCH`, in which
    case `_check` runs to name the fault. None for hints it does not cover. Keeps the cost of a
    report at its bounds to a few microseconds per item."""
    limit = Limit()
    if typing.get_origin(hint) is Annotated:
        hint, *extra = typing.get_args(hint)
        if len(extra) != 1 or not isinstance(extra[0], Limit):
            return None
        limit = extra[0]
    if hint is str:
        most = min(MAX_TEXT, limit.max_len if limit.max_len is not None else MAX_TEXT)
        return lambda v: v if type(v) is str and len(v) <= most else _MISMATCH
    if hint is int:
        lo = max(INT64.lo, limit.lo if limit.lo is not None else INT64.lo)
        hi = min(INT64.hi, limit.hi if limit.hi is not None else INT64.hi)
        return lambda v: v if type(v) is int and lo <= v <= hi else _MISMATCH
    if typing.get_origin(hint) is tuple and limit == Limit():
        items = typing.get_args(hint)
        checks = [_fast_check(h) for h in items]
        if not items or Ellipsis in items or None in checks:
            return None

        size = len(checks)

        def check_tuple(v: Any) -> Any:
            if (type(v) is not list and type(v) is not tuple) or len(v) != size:
                return _MISMATCH
            out = tuple([c(x) for c, x in zip(checks, v)])  # noqa: B905 (lengths checked above)
            return _MISMATCH if _MISMATCH in out else out

        def check_pair(v: Any) -> Any:  # (name, version) pairs fill the longest lists: one call each, not three
            if (type(v) is not list and type(v) is not tuple) or len(v) != 2:
                return _MISMATCH
            a, b = checks[0](v[0]), checks[1](v[1])
            return _MISMATCH if a is _MISMATCH or b is _MISMATCH else (a, b)

        return check_pair if size == 2 else check_tuple
    return None


def _check_tuple(value: Any, hint: Any, where: str) -> tuple:
    _expect(value, list | tuple, where)  # msgpack arrays decode as lists
    items = typing.get_args(hint)
    if len(items) == 2 and items[1] is Ellipsis:
        items = (items[0],) * len(value)
    if len(value) != len(items):
        raise WireError(f"{where}: expected {len(items)} items, got {len(value)}")
    return tuple(_check(v, h, f"{where}[{i}]") for i, (v, h) in enumerate(zip(value, items, strict=True)))


def _check_dict(value: Any, hint: Any, where: str) -> dict:
    _expect(value, dict, where)
    _within(value, Limit(max_len=MAX_LIST), where)
    key_hint, value_hint = typing.get_args(hint) or (str, Any)
    return {
        _check(k, key_hint, f"{where} key"): _check(v, value_hint, f"{where}[{str(k)[:32]!r}]")
        for k, v in value.items()
    }


_CHECKERS: dict[Any, Any] = {
    type(None): _check_none,
    bool: _check_bool,
    int: _check_int,
    float: _check_float,
    str: _check_str,
    bytes: _check_buffer,
    memoryview: _check_buffer,
    list: _check_list,
    tuple: _check_tuple,
    dict: _check_dict,
}
