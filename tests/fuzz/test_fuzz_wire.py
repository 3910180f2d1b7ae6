"""Property-based fuzzing of every internal wire message type.

(a) pure: random frames, random maps and valid messages with one field replaced by a random
    value go into `wire.decode`: it raises WireError and nothing else, and whatever it accepts
    satisfies the schema (it survives encode -> decode unchanged).
(b) live: the same kinds of messages are sent to a running scheduler's worker port (a real
    process) and to a gateway's token sink; both keep working afterwards.

The CI budget is small: 150 examples per property by default. For a longer local run set
LORASERVE_FUZZ_EXAMPLES, e.g. `LORASERVE_FUZZ_EXAMPLES=20000 pytest tests/fuzz/test_fuzz_wire.py`.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
from grpc_health.v1 import health_pb2
from hypothesis import given
from scheduler_proc import FakeWorker, SchedulerProcess
from wire_fuzz import FUZZ, VALID, any_frames

from loraserve.gateway.token_sink import TokenSink
from loraserve.sockets import make_socket, send
from loraserve.wire import Message, Tokens, WireError, decode, encode


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
