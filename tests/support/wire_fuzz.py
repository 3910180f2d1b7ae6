"""Hypothesis strategies for internal wire messages, shared by the wire fuzzers.

`VALID` holds one valid message of every type; `any_frames` draws a valid message with one field
replaced or dropped, one with a string that is not UTF-8, a random map under a (known or unknown) type
byte, or raw frames. With CI set they are derandomized (tests/conftest.py).
"""

from __future__ import annotations

import os

import msgpack
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st

from loraserve.params import SamplingParams
from loraserve.request_spec import RequestSpec
from loraserve.wire import (
    _TYPES,
    AdapterPayload,
    AdapterRows,
    Assign,
    Cancel,
    FetchAdapter,
    FetchFailed,
    Heartbeat,
    Message,
    MsgType,
    Prefetch,
    StepTokens,
    Tokens,
    WorkerReport,
    encode,
)

EXAMPLES = int(os.environ.get("LORASERVE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

VALID: list[Message] = [
    WorkerReport("w", True, 8, 100, 50, 40, 10, ["a"], ["b"], [("x", 1)], finished=["c"], waste_fraction=0.5),
    Assign(
        RequestSpec(
            "r",
            [1, 2],
            SamplingParams(max_new_tokens=4, stop_token_ids=(2,)),
            "tcp://127.0.0.1:7201",
            1.0,
            adapter="x",
            adapter_version=1,
            deadline=2.0,
        ),
        queued_s=0.5,
        trace={"traceparent": "00-1"},
    ),
    Cancel(["r"], "client cancelled"),
    Prefetch([("x", 1), ("y", 2)]),
    Prefetch([("x", 1), ("y", 2)], [0.9, 0.25]),
    Tokens("r", [1], "w", True, "stop", timings={"queue_s": 0.1}),
    FetchAdapter("x", 1, {"traceparent": "00-1"}),
    FetchAdapter("x", 1, {}, row_width=64, num_layers=2, shared_memory=True),
    AdapterPayload("x", 1, "safetensors", b"{}", b"weights"),
    AdapterRows("x", 1, "ab" * 32, 2, ["q_proj"], [0, 1], "float32", 2, 4, 8, ["cd" * 32] * 2, config_json=b"{}"),
    FetchFailed("x", 1, "NOT_FOUND", "no such adapter"),
    StepTokens("w", ["r", "s"], [[1, 2], []]),
    Heartbeat("w", "instance-1", step_s=2.5),
]
assert {type(m) for m in VALID} == set(_TYPES.values()), "every message type is fuzzed"

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.sampled_from(["tcp://127.0.0.1:1", "not-an-endpoint", "ipc://"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)


def _packable(value) -> bool:
    try:
        msgpack.packb(value, use_bin_type=True)
        return True
    except (OverflowError, ValueError, TypeError):
        return False


def _field(draw, body: dict) -> tuple[dict, str]:
    """A map of `body` (itself, or a nested one: an ASSIGN's spec, or the spec's sampling) and a name in it
    (or a stray one)."""
    target = body
    while True:
        name = draw(st.sampled_from([*target, "stray"]))
        if not isinstance(target.get(name), dict) or not draw(st.booleans()):
            return target, name
        target = target[name]


@st.composite
def mutated(draw) -> list[bytes]:
    """A valid message with one field replaced, dropped, or a stray field added; the field may be one of
    a nested map (an ASSIGN's spec, or the spec's sampling)."""
    message = draw(st.sampled_from(VALID))
    frames = [bytes(f) for f in encode(message)]
    body = msgpack.unpackb(frames[1])
    target, name = _field(draw, body)
    action = draw(st.sampled_from(["replace", "drop"]))
    if action == "drop":
        target.pop(name, None)
    else:
        target[name] = draw(values.filter(_packable))
    return [frames[0], msgpack.packb(body, use_bin_type=True), *frames[2:]]


# Byte strings that are not UTF-8: a lone continuation byte, a truncated sequence, an overlong encoding,
# an encoded surrogate, bytes UTF-8 never uses.
NOT_UTF8 = [b"\xa0\xa1", b"\xc3\x28", b"\xe2\x82", b"\xc0\x80", b"\xed\xa0\x80", b"\xff\xfe"]
_MARKS = {2: "\u07fe", 3: "\uffef"}  # UTF-8 strings as long as bad bytes, to stand for them in a packed body


@st.composite
def not_utf8(draw) -> list[bytes]:
    """A valid message with one string (a field's value or a field's name, maybe of a nested map) whose bytes
    are not UTF-8: what a forged frame, or another language's msgpack encoder, can send."""
    message = draw(st.sampled_from(VALID))
    frames = [bytes(f) for f in encode(message)]
    body = msgpack.unpackb(frames[1])
    target, name = _field(draw, body)
    bad = draw(st.sampled_from(NOT_UTF8))
    mark = _MARKS[len(bad)]
    if draw(st.booleans()):
        target[name] = mark
    else:
        target[mark] = target.pop(name, 0)
    packed = msgpack.packb(body, use_bin_type=True)
    assume(packed.count(mark.encode()) == 1)  # the mark alone holds those bytes
    return [frames[0], packed.replace(mark.encode(), bad), *frames[2:]]


@st.composite
def random_map(draw) -> list[bytes]:
    """A type byte (known or not) and a map of known field names with random values."""
    kind = draw(st.sampled_from([*(bytes([t]) for t in MsgType), b"\x00", b"\xff", b"", b"\x01\x01"]))
    cls = _TYPES.get(kind[0]) if len(kind) == 1 else None
    names = list(cls.__struct_fields__) if cls else ["x"]
    body = draw(st.dictionaries(st.sampled_from(names), values, max_size=len(names)).filter(_packable))
    extra = draw(st.lists(st.binary(max_size=20), max_size=3))
    return [kind, msgpack.packb(body, use_bin_type=True), *extra]


raw_frames = st.lists(st.binary(max_size=64), max_size=5)
any_frames = st.one_of(mutated(), not_utf8(), random_map(), raw_frames)
