"""The ZMQ wire format between roles: typed msgpack messages, bulk bytes in frames of their own.

A message is a multipart ZMQ message:

    frame 0: one byte, the message type (MsgType)
    frame 1: msgpack map of the message's fields
    frame 2...: raw buffers (adapter files, packed rows), sent and received without copies

Every message is a msgspec Struct, and its type hints are its schema: element types, tuple shapes,
string and list lengths and numeric ranges (`msgspec.Meta` annotations), finite floats, no field
unknown or missing. `Message.check` (run by `decode`) checks what crosses fields, such as lengths
that must agree; the request spec checks its own on construction (`loraserve/request_spec.py`).
Anything else is a WireError, the only exception `decode` raises, naming the message and the
field. Roles log it (rate-limited, `loraserve/log_limit.py`) and drop the message: a peer can make
a role ignore a message, never crash or corrupt it. Nothing is ever pickled: a peer sends only data.
"""

from __future__ import annotations

import enum
import functools
import re
import sys
from typing import Annotated, Any, ClassVar, NamedTuple

import msgspec

from loraserve.bounds import MAX_ID, MAX_LIST, Count, Finite, Id, Seconds, TokenId, TokenIds, Version
from loraserve.errors import LoraserveError
from loraserve.params import MAX_LOGPROBS
from loraserve.prefix_keys import FINGERPRINT_BYTES
from loraserve.request_spec import RequestSpec
from loraserve.struct_errors import DECODE_ERRORS, decode_problem

MAX_TEXT = 64 * 1024  # characters of an error message or reason

__all__ = [  # the messages, their vocabulary, and the bounds re-exported from `loraserve/bounds.py`
    "MAX_ID",
    "MAX_LIST",
    "MAX_TEXT",
    "AdapterKey",
    "AdapterPayload",
    "AdapterRows",
    "Assign",
    "Cancel",
    "FetchAdapter",
    "FetchFailed",
    "Heartbeat",
    "Message",
    "MsgType",
    "Prefetch",
    "RequestSpec",
    "StepTokens",
    "TokenLogprob",
    "Tokens",
    "WireError",
    "WorkerReport",
    "decode",
    "encode",
]


class WireError(ValueError):
    """A frame sequence that is not a valid loraserve message."""


class MsgType(enum.IntEnum):
    WORKER_REPORT = 1  # worker -> scheduler: state after a step, and every 0.25 s when idle
    ASSIGN = 2  # scheduler -> worker: run this request
    CANCEL = 3  # scheduler -> worker: stop these requests
    PREFETCH = 4  # scheduler -> worker: adapters it will likely need next
    TOKENS = 5  # worker (or scheduler, for failures) -> gateway: new tokens, maybe the end
    FETCH_ADAPTER = 6  # worker -> adapter store: send me this adapter version
    ADAPTER = 7  # adapter store -> worker: the adapter's files (2 raw frames)
    FETCH_FAILED = 8  # adapter store -> worker: could not serve a fetch
    STEP_TOKENS = 9  # worker -> gateway: one step's new tokens for all of this gateway's requests
    ADAPTER_ROWS = 10  # adapter store -> worker: the adapter packed in the pool's row layout (`pool_rows.py`)
    HEARTBEAT = 11  # worker -> scheduler: alive (from its I/O thread, on its own schedule), and its step's age


# ---- the schema vocabulary (more in `loraserve/request_spec.py`) ------------------------------
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
MAX_RANKS = 64  # tensor-parallel ranks of one worker whose part of the rows a fetch may ask for
MAX_STEP_S = 1e9  # a heartbeat's age of the step under way, in seconds


def _str(n: int) -> Any:
    return Annotated[str, msgspec.Meta(max_length=n)]


def _list(item: Any, n: int) -> Any:
    return Annotated[list[item], msgspec.Meta(max_length=n)]


def _int(lo: int, hi: int) -> Any:
    return Annotated[int, msgspec.Meta(ge=lo, le=hi)]


def _float(lo: float, hi: float) -> Any:
    return Annotated[float, msgspec.Meta(ge=lo, le=hi)]


Text = _str(MAX_TEXT)
Status = _str(32)  # a grpc.StatusCode name, or a finish reason
AdapterRef = tuple[Id, Version]  # (name, version) on the wire
AdapterKey = tuple[str, int]  # (name, version) in every role: an adapter version's one name
Ids = _list(Id, MAX_IDS)
ReportedIds = _list(Id, MAX_REPORTED_IDS)
Probability = _float(0.0, 1.0)
StepSample = tuple[Count, Count, Count, Count, _float(0.0, 3600.0)]
TraceCarrier = Annotated[dict[Id, _str(1024)], msgspec.Meta(max_length=16)]  # W3C trace context
# A token's log-probability, then the ids and log-probabilities of the most likely tokens at its position.
Logprob = tuple[Finite, _list(TokenId, MAX_LOGPROBS), _list(Finite, MAX_LOGPROBS)]
Logprobs = _list(Logprob, MAX_LIST)


class TokenLogprob(NamedTuple):
    """A `Logprob` in every role: packed as the tuple it is, decoded as a tuple (`TokenLogprob(*t)`)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """A wire message: its `TYPE` travels in frame 0, its fields in frame 1 (bar `BUFFERS`)."""

    TYPE: ClassVar[MsgType]
    BUFFERS: ClassVar[tuple[str, ...]] = ()  # bytes fields carried as raw frames after the map

    def check(self) -> None:
        """Invariants across fields, run by `decode` after every field matched its type (ValueError)."""


# ---- the messages -----------------------------------------------------------------------------
class WorkerReport(Message):
    TYPE: ClassVar[MsgType] = MsgType.WORKER_REPORT
    worker_id: Id
    ready: bool
    max_batch_size: _int(0, MAX_BATCH)
    total_pages: Count
    free_pages: Count
    kv_pages: Count
    adapter_pages: Count
    running: ReportedIds  # request ids in the running batch
    waiting: ReportedIds  # request ids assigned but not yet running
    # [(adapter name, version), ...], least recently used first; the most recent MAX_RESIDENT at most.
    # None: the same set as in the last report that carried it (workers send it when the set changed,
    # and every few seconds in any case: `worker/reporter.py`).
    resident: _list(AdapterRef, MAX_RESIDENT) | None = None
    finished: ReportedIds = msgspec.field(default_factory=list)  # request ids that ended since the last report
    evictable_pages: Count = 0  # pages of cached adapters no request uses, and idle cached KV pages (reclaimable)
    cached_pages: Count = 0  # idle KV pages kept for the prefix cache (among evictable_pages)
    tokens_per_page: _int(1, 1 << 20) = 16
    steps: Count = 0
    prefetch_hits: Count = 0
    prefetch_misses: Count = 0
    waste_fraction: _float(0.0, 1.0) = 0.0
    fatal: Text | None = None  # set on the last report of a worker that is dying
    instance: _str(64) = ""  # random per worker process: a new one means it restarted
    draining: bool = False  # SIGTERM: finishing what it holds, taking nothing new
    # Steps measured since the last report, for the scheduler's step-cost model (scheduler/cost_model.py):
    # (tokens computed, Σ adapter rank over those tokens, distinct adapters, KV pages read, seconds).
    step_samples: _list(StepSample, MAX_STEP_SAMPLES) = msgspec.field(default_factory=list)
    # Prefix caching: fingerprints of the prefixes cached here (`loraserve/prefix_keys.py`), 16 bytes
    # each, concatenated, most recently used first, at most MAX_PREFIXES; None: as in the last report.
    cached_prefixes: bytes | None = None

    def check(self) -> None:
        for name in ("free_pages", "kv_pages", "adapter_pages", "evictable_pages", "cached_pages"):
            if getattr(self, name) > self.total_pages:
                raise ValueError(f"{name}: more than total_pages ({self.total_pages})")
        prefixes = self.cached_prefixes
        if prefixes is not None and (
            len(prefixes) % FINGERPRINT_BYTES or len(prefixes) > MAX_PREFIXES * FINGERPRINT_BYTES
        ):
            raise ValueError(
                f"cached_prefixes: must be at most {MAX_PREFIXES} fingerprints of {FINGERPRINT_BYTES} bytes each"
            )

    def prefixes(self) -> list[bytes]:
        """`cached_prefixes` as one fingerprint each (empty when None)."""
        blob = self.cached_prefixes or b""
        return [blob[i : i + FINGERPRINT_BYTES] for i in range(0, len(blob), FINGERPRINT_BYTES)]


class Heartbeat(Message):
    """A worker is alive: sent by its I/O thread every 0.25 s whatever its step loop is doing
    (`worker/io_thread.py`); the scheduler keeps a worker on any message from it. Small and fixed in
    size, beside the reports the step loop sends after its steps."""

    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    worker_id: Id
    instance: _str(64) = ""  # as in its reports: a heartbeat of another process under the same id is ignored
    step_s: _float(0.0, MAX_STEP_S) = 0.0  # how long the step under way has been running (0: none is)


class Assign(Message):
    """Run this request: its spec as the scheduler accepted it, and what its time in the queue added."""

    TYPE: ClassVar[MsgType] = MsgType.ASSIGN
    spec: RequestSpec
    queued_s: Seconds = 0.0  # time spent in the scheduler's queue
    trace: TraceCarrier = msgspec.field(default_factory=dict)  # W3C trace context carrier


class Cancel(Message):
    TYPE: ClassVar[MsgType] = MsgType.CANCEL
    request_ids: Ids
    reason: Text = ""


class Prefetch(Message):
    TYPE: ClassVar[MsgType] = MsgType.PREFETCH
    adapters: _list(AdapterRef, MAX_PREFETCH)  # [(name, version), ...], most urgent first
    # scores[i]: the predicted likelihood that adapters[i] is needed on this worker soon. The worker
    # remembers the latest score of each adapter, and a prefetch evicts only adapters scored lower
    # than the one it fetches. Empty: unknown, each counts as UNKNOWN_SCORE (see worker/unified_pool.py).
    scores: _list(Probability, MAX_PREFETCH) = msgspec.field(default_factory=list)
    # A gateway's hint for one request (`scheduler/hints.py`): that request's trace, which the fetch joins.
    trace: TraceCarrier = msgspec.field(default_factory=dict)

    def check(self) -> None:
        if self.scores and len(self.scores) != len(self.adapters):
            raise ValueError("scores and adapters differ in length")


class Tokens(Message):
    TYPE: ClassVar[MsgType] = MsgType.TOKENS
    request_id: Id
    token_ids: TokenIds
    worker_id: Id = ""
    finished: bool = False
    finish_reason: Status | None = None  # "stop" | "length" when finished normally
    error_status: Status | None = None  # a grpc.StatusCode name when it failed
    error: Text | None = None
    # With error_status UNAVAILABLE: the request did not fail by itself, its worker was lost (killed,
    # stopped, drained past its timeout); the gateway may resubmit it with the tokens it streamed.
    retry: bool = False
    # With retry: the scheduler moved the request (migration) from a worker that is fine; the gateway does
    # not count it as a worker lost under the request (`gateway/failover.py`).
    moved: bool = False
    # worker-side: queue_s, adapter_load_s, prefill_s, decode_s, ...
    timings: Annotated[dict[Id, Seconds], msgspec.Meta(max_length=32)] = msgspec.field(default_factory=dict)
    # With sampling logprobs: one per token of token_ids. With prompt_logprobs, on the message that
    # brings the first token: one per prompt token after the first.
    logprobs: Logprobs = msgspec.field(default_factory=list)
    prompt_logprobs: Logprobs = msgspec.field(default_factory=list)
    cached_tokens: Count = 0  # with its first token, and on the message that ends it: prompt tokens found cached

    def check(self) -> None:
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            raise ValueError("logprobs and token_ids differ in length")
        _check_top_lengths(self.logprobs, self.prompt_logprobs)


class StepTokens(Message):
    """One engine step's new tokens for every running request of one gateway: one message per
    gateway per step instead of one per request. Ends no request (a last token and the finish
    reason travel in a `Tokens` of their own)."""

    TYPE: ClassVar[MsgType] = MsgType.STEP_TOKENS
    worker_id: Id
    request_ids: Ids
    token_ids: _list(TokenIds, MAX_IDS)  # token_ids[i] belong to request_ids[i]
    # Empty when no request of the step asked for them; else one list per request, as in `Tokens`.
    logprobs: _list(Logprobs, MAX_IDS) = msgspec.field(default_factory=list)
    prompt_logprobs: _list(Logprobs, MAX_IDS) = msgspec.field(default_factory=list)
    # Empty when no request of the step reports cached prompt tokens; else one count per request.
    cached_tokens: _list(Count, MAX_IDS) = msgspec.field(default_factory=list)

    def check(self) -> None:
        if len(self.request_ids) != len(self.token_ids):
            raise ValueError("request_ids and token_ids differ in length")
        for name in ("logprobs", "prompt_logprobs", "cached_tokens"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.request_ids):
                raise ValueError(f"request_ids and {name} differ in length")
        for i, (logprobs, token_ids) in enumerate(zip(self.logprobs, self.token_ids)):  # noqa: B905 (may be empty)
            if logprobs and len(logprobs) != len(token_ids):
                raise ValueError(f"logprobs[{i}] and token_ids[{i}] differ in length")
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
                raise ValueError("a logprob's top_ids and top_logprobs differ in length")


class FetchAdapter(Message):
    TYPE: ClassVar[MsgType] = MsgType.FETCH_ADAPTER
    name: Id
    version: Version
    trace: TraceCarrier = msgspec.field(default_factory=dict)
    # Rows: ask for the adapter packed in the pool's row layout of a model of this shape (an AdapterRows
    # reply; a store without rows, or for another shape, answers with the files). 0: the files.
    row_width: _int(0, 1 << 20) = 0
    num_layers: _int(0, MAX_ROW_LAYERS) = 0
    shared_memory: bool = False  # the worker can map the store's shared-memory files (same host, same user)
    # Tensor parallelism: the rows of rank `tp_rank` of `tp_size` (its part, `loraserve/partition.py`).
    tp_size: _int(1, MAX_RANKS) = 1
    tp_rank: _int(0, MAX_RANKS - 1) = 0


class AdapterPayload(Message):
    """Header in the map; the files' bytes in frames 2 (adapter_config.json) and 3 (weights)."""

    TYPE: ClassVar[MsgType] = MsgType.ADAPTER
    name: Id
    version: Version
    weights_format: _str(32)  # "safetensors"
    config_json: bytes = b""  # carried as a raw frame (a memoryview once decoded)
    weights: bytes = b""  # carried as a raw frame (a memoryview once decoded)
    sha256: _str(64) = ""  # hex SHA-256 of `weights`; the fetcher refuses bytes that differ
    BUFFERS: ClassVar[tuple[str, ...]] = ("config_json", "weights")


class AdapterRows(Message):
    """An adapter version packed in the pool's row layout (`loraserve/pool_rows.py`): the header in the map,
    adapter_config.json in frame 2, the rows in frame 3 — or, with `shm_name`, an empty frame 3 and the rows
    in the store's shared-memory file of that name, whose header carries `shm_token`."""

    TYPE: ClassVar[MsgType] = MsgType.ADAPTER_ROWS
    name: Id
    version: Version
    sha256: _str(64)  # of the weights file the rows were packed from (its identity)
    rank: _int(1, 1 << 16)
    modules: _list(_str(16), 8)  # targeted, LORA_MODULES order
    layers: _list(_int(0, MAX_ROW_LAYERS - 1), MAX_ROW_LAYERS)  # with weights
    dtype: _str(16)  # "float16" | "bfloat16" | "float32" | "float64"
    num_layers: _int(1, MAX_ROW_LAYERS)
    num_rows: _int(1, 1 << 24)
    row_width: _int(1, 1 << 20)
    digests: _list(_str(64), MAX_ROW_LAYERS)  # sha256 per layer
    shm_name: _str(128) = ""  # "": the rows are in frame 3
    shm_token: _str(64) = ""
    tp_size: _int(1, MAX_RANKS) = 1  # the part of the rows these are, as asked for
    tp_rank: _int(0, MAX_RANKS - 1) = 0
    config_json: bytes = b""  # carried as a raw frame (a memoryview once decoded)
    rows: bytes = b""  # carried as a raw frame (a memoryview once decoded)
    BUFFERS: ClassVar[tuple[str, ...]] = ("config_json", "rows")

    def check(self) -> None:
        if len(self.digests) != self.num_layers:
            raise ValueError("digests and num_layers differ")
        if bool(self.shm_name) != bool(self.shm_token):
            raise ValueError("shm_name and shm_token go together")


class FetchFailed(Message):
    TYPE: ClassVar[MsgType] = MsgType.FETCH_FAILED
    name: Id
    version: Version
    status: Status  # a grpc.StatusCode name
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
        Heartbeat,
    )
}


# ---- encoding and decoding --------------------------------------------------------------------
_ENCODER = msgspec.msgpack.Encoder()


def encode(message: Message) -> list[bytes | memoryview]:
    """Frames for `message`; send with send_multipart(frames, copy=False) to avoid copying buffers."""
    buffers = message.BUFFERS
    if buffers:
        body = {name: getattr(message, name) for name in message.__struct_fields__ if name not in buffers}
        return [bytes([message.TYPE]), _ENCODER.encode(body), *(getattr(message, b) for b in buffers)]
    return [bytes([message.TYPE]), _ENCODER.encode(message)]


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
    if len(frames) != 2 + len(cls.BUFFERS):
        raise WireError(f"{cls.__name__}: expected {2 + len(cls.BUFFERS)} frames, got {len(frames)}")
    body = _buffer(frames[1])
    try:
        message = _decoder(cls).decode(body)
    except msgspec.ValidationError as e:
        raise WireError(_describe(cls.__name__, str(e), body)) from None
    except DECODE_ERRORS as e:
        raise WireError(f"{cls.__name__}: body {decode_problem(e, not_decodable='is not msgpack: ')}") from None
    except LoraserveError as e:  # a spec's cross-field or sampling check (`RequestSpec`, `SamplingParams`)
        raise WireError(f"{cls.__name__}.spec: {e}") from None
    try:
        message.check()
    except ValueError as e:
        raise WireError(f"{cls.__name__}: {e}") from None
    for name, frame in zip(cls.BUFFERS, frames[2:], strict=True):
        if getattr(message, name):
            raise WireError(f"{cls.__name__}: buffers travel as frames, not in the map")
        setattr(message, name, frame.buffer if hasattr(frame, "buffer") else frame)
    return message


@functools.cache
def _decoder(cls: type[Message]) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(cls)


def _buffer(frame: Any) -> Any:
    if hasattr(frame, "buffer"):
        return frame.buffer
    if isinstance(frame, bytes | bytearray | memoryview):
        return frame
    raise WireError(f"a frame must be bytes, got {type(frame).__name__}")


def _bytes(frame: Any) -> bytes:
    return bytes(_buffer(frame))


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_TOO_LONG = re.compile(r"^Expected `(?:array|object|str)` of length <= (?P<most>\d+)$")
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_FINITE = f"Expected `float` >= {-sys.float_info.max!r}"


def _describe(name: str, error: str, body: Any) -> str:
    """msgspec's error as "Message.field.path: what is wrong", in the words loraserve's logs use."""
    match = _AT.match(error)
    what, path = match["what"], match["path"] or ""
    where = f"{name}{path}"
    if what.startswith("Object missing required field"):
        return f"{where}: missing field {what.split('`')[1]!r}"
    if what.startswith("Object contains unknown field"):
        return f"{where}: unknown field {what.split('`')[1][:64]!r}"
    if what.startswith(_FINITE) or what.startswith(f"Expected `float` <= {sys.float_info.max!r}"):
        return f"{where}: not a finite number"
    if what == "Expected `object`, got `array`" and not path:
        return f"{name}: body must be a map"
    too_long = _TOO_LONG.match(what)
    if too_long:
        return f"{where}: longer than {too_long['most']}{_length_at(body, path)}"
    return f"{where}: {what}"


def _length_at(body: Any, path: str) -> str:
    """ " (got N)": the length of the value at `path` in the raw body (only on the way to an error)."""
    try:
        value = msgspec.msgpack.decode(body)
        for key, index in _PATH_PART.findall(path):
            value = value[key] if key else value[int(index)]
        return f" (got {len(value)})"
    except Exception:
        return ""


RESIDENT_RESEND_S = 2.0  # a worker names its resident adapters when the set changed, and this often when not


class ResidentNews:
    """What a worker's next report says of its resident adapters: the list when the set changed since it
    last went out, and every RESIDENT_RESEND_S in any case (a scheduler that restarted learns it); else
    None. Their order changes with every step that uses one; the scheduler reads only the set."""

    def __init__(self) -> None:
        self._sent: frozenset = frozenset()
        self._sent_at = -RESIDENT_RESEND_S

    def news(self, resident: list, now: float) -> list[list] | None:
        """`resident` (least recently used first) as the report's `resident`, or None; `now`: monotonic."""
        kept = frozenset(resident)
        if kept == self._sent and now - self._sent_at < RESIDENT_RESEND_S:
            return None
        self._sent, self._sent_at = kept, now
        return [list(k) for k in resident]
