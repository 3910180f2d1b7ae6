"""Property-based fuzzing of every internal wire message type (issue 9).

(a) pure: random frames, random maps and valid messages with one field replaced by a random
    value go into `wire.decode`: it raises WireError and nothing else, and whatever it accepts
    satisfies the schema (it survives encode -> decode unchanged).
(b) live: the same kinds of messages are sent to a running scheduler's worker port (a real
    process) and to a gateway's token sink; both keep working afterwards.

The CI budget is small: 150 examples per property by default. For a longer local run set
LORASERVE_FUZZ_EXAMPLES, e.g. `LORASERVE_FUZZ_EXAMPLES=20000 pytest tests/test_fuzz_wire.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import msgpack
import pytest
import zmq
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_proc import FakeWorker, SchedulerProcess

from loraserve.gateway.token_sink import TokenSink
from loraserve.sockets import make_socket, send
from loraserve.wire import (
    _TYPES,
    AdapterFiles,
    Assign,
    Cancel,
    FetchAdapter,
    FetchFailed,
    Message,
    MsgType,
    Prefetch,
    Tokens,
    WireError,
    WorkerReport,
    decode,
    encode,
)

EXAMPLES = int(os.environ.get("LORASERVE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

VALID: list[Message] = [
    WorkerReport("w", True, 8, 100, 50, 40, 10, ["a"], ["b"], [("x", 1)], finished=["c"], waste_fraction=0.5),
    Assign(
        "r",
        [1, 2],
        "x",
        1,
        {"max_new_tokens": 4, "stop_token_ids": [2]},
        "tcp://127.0.0.1:7201",
        1.0,
        deadline=2.0,
        trace={"traceparent": "00-1"},
    ),
    Cancel(["r"], "client cancelled"),
    Prefetch([("x", 1), ("y", 2)]),
    Tokens("r", [1], "w", True, "stop", timings={"queue_s": 0.1}),
    FetchAdapter("x", 1, {"traceparent": "00-1"}),
    AdapterFiles("x", 1, "safetensors", b"{}", b"weights"),
    FetchFailed("x", 1, "NOT_FOUND", "no such adapter"),
]
assert {type(m) for m in VALID} == set(_TYPES.values()), "every message type is fuzzed"

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**64), 2**64 - 1), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40), st.binary(max_size=40), st.sampled_from(["tcp://127.0.0.1:1", "not-an-endpoint", "ipc://"]),
)  # fmt: skip
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


@st.composite
def mutated(draw) -> list[bytes]:
    """A valid message with one field replaced, dropped, or a stray field added."""
    message = draw(st.sampled_from(VALID))
    frames = [bytes(f) for f in encode(message)]
    body = msgpack.unpackb(frames[1])
    name = draw(st.sampled_from([*body, "stray"]))
    action = draw(st.sampled_from(["replace", "drop"]))
    if action == "drop":
        body.pop(name, None)
    else:
        body[name] = draw(values.filter(_packable))
    return [frames[0], msgpack.packb(body, use_bin_type=True), *frames[2:]]


@st.composite
def random_map(draw) -> list[bytes]:
    """A type byte (known or not) and a map of known field names with random values."""
    kind = draw(st.sampled_from([*(bytes([t]) for t in MsgType), b"\x00", b"\xff", b"", b"\x01\x01"]))
    cls = _TYPES.get(kind[0]) if len(kind) == 1 else None
    names = [f.name for f in dataclasses.fields(cls)] if cls else ["x"]
    body = draw(st.dictionaries(st.sampled_from(names), values, max_size=len(names)).filter(_packable))
    extra = draw(st.lists(st.binary(max_size=20), max_size=3))
    return [kind, msgpack.packb(body, use_bin_type=True), *extra]


raw_frames = st.lists(st.binary(max_size=64), max_size=5)
any_frames = st.one_of(mutated(), random_map(), raw_frames)


def _decode_only_wire_errors(frames: list[bytes]) -> Message | None:
    try:
        message = decode(frames)
    except WireError:
        return None
    assert decode([bytes(f) for f in encode(message)]) == message, "an accepted message satisfies its schema"
    return message


@FUZZ
@given(any_frames)
def test_decode_raises_only_wire_errors_and_accepts_only_schema_valid_messages(frames):
    _decode_only_wire_errors(frames)


def test_every_valid_message_round_trips():
    for message in VALID:
        assert _decode_only_wire_errors([bytes(f) for f in encode(message)]) is not None


@pytest.fixture(scope="module")
def scheduler():
    process = SchedulerProcess(worker_timeout=2.0)
    worker = None
    try:
        process.wait_serving()
        worker = FakeWorker(process.worker_address)
        process.wait_worker("w1")
        yield process, worker
    finally:
        if worker is not None:
            worker.close()
        process.stop()


def test_a_running_scheduler_survives_fuzzed_worker_messages(scheduler):
    process, worker = scheduler
    ctx = zmq.Context()
    attacker = make_socket(ctx, zmq.DEALER, connect=process.worker_address, identity="fuzzer")

    @FUZZ
    @given(any_frames)
    def send_one(frames):
        attacker.send_multipart(frames or [b""])

    try:
        send_one()
        send(attacker, VALID[0])  # a valid report under another identity is dropped, not registered
        time.sleep(0.3)
        assert process.process.poll() is None, process.output()
        assert process.status() == health_pb2.HealthCheckResponse.SERVING
        process.submit("after-fuzz", "tcp://127.0.0.1:9")
        worker.wait_assigned("after-fuzz")
    finally:
        attacker.close(linger=0)
        ctx.term()


def test_a_token_sink_survives_fuzzed_messages():
    async def scenario() -> Tokens:
        sink = TokenSink("tcp://127.0.0.1:*")
        stream = sink.open("r")
        runner = asyncio.create_task(sink.run())
        ctx = zmq.Context()
        push = make_socket(ctx, zmq.PUSH, connect=sink.address)

        @FUZZ
        @given(any_frames)
        def send_one(frames):
            push.send_multipart(frames or [b""])

        send_one()
        send(push, Tokens("r", [7], finished=True, finish_reason="stop"))
        try:
            while True:  # fuzzed messages may have been valid Tokens for "r": wait for ours
                tokens = await asyncio.wait_for(stream.get(), 10)
                if tokens.token_ids == [7] and tokens.finish_reason == "stop":
                    break
            assert not runner.done()
            return tokens
        finally:
            runner.cancel()
            push.close(linger=0)
            ctx.term()
            sink.shutdown()

    assert asyncio.run(scenario()).finished
