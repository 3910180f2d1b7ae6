"""FailoverStream and Streams (gateway/failover.py) over a real token sink: TOKENS messages are
pushed over ZMQ as a worker or the scheduler would; the scheduler's Submit is a recording function."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from loraserve.errors import UnavailableError
from loraserve.gateway.failover import FailoverConfig, FailoverStream, Streams
from loraserve.gateway.token_sink import TokenSink
from loraserve.sockets import make_socket, send
from loraserve.wire import Tokens

CONFIG = FailoverConfig(max_failovers=2, inactivity_timeout_s=5.0)


class Harness:
    """A real TokenSink, a PUSH socket into it, and a record of submits and cancels."""

    def __init__(self, config: FailoverConfig = CONFIG):
        self.sink = TokenSink("tcp://127.0.0.1:*")
        self.push = make_socket(zmq.Context.instance(), zmq.PUSH, connect=self.sink.address)
        self.submits: list[tuple[str, list[int]]] = []
        self.cancels: list[str] = []
        self.instance = "scheduler-1"
        self.config = config

    def stream(self, request_id: str = "r") -> FailoverStream:
        async def submit(attempt_id: str, attempt: int, output_ids: list[int]) -> str:
            assert attempt_id.endswith(f".{attempt}") if attempt else "." not in attempt_id
            self.submits.append((attempt_id, output_ids))
            return self.instance

        return FailoverStream(request_id, self.sink, submit, lambda i, _: self.cancels.append(i), self.config)

    def push_tokens(self, request_id: str, tokens: list[int], **fields) -> None:
        send(self.push, Tokens(request_id, tokens, **fields))

    async def submitted(self, count: int) -> None:
        while len(self.submits) < count:
            await asyncio.sleep(0.01)

    def close(self) -> None:
        self.push.close(linger=0)
        self.sink.shutdown()


async def _collect(stream: FailoverStream) -> list[Tokens]:
    return [m async for m in stream.messages()]


def with_harness(test):
    """Run an async test with a Harness whose sink runs meanwhile (no async plugin needed)."""

    def run(config: FailoverConfig | None = None):
        async def body():
            h = Harness(config or CONFIG)
            sink_task = asyncio.create_task(h.sink.run())
            try:
                await test(h)
            finally:
                sink_task.cancel()
                h.close()

        asyncio.run(body())

    run.__name__ = test.__name__
    return run


@with_harness
async def test_a_lost_attempt_continues_as_a_new_one_with_the_tokens_streamed_so_far(harness):
    stream = harness.stream()
    collecting = asyncio.create_task(_collect(stream))
    await harness.submitted(1)
    harness.push_tokens("r", [], worker_id="w0")  # the worker's acknowledgement
    harness.push_tokens("r", [5, 6, 7], worker_id="w0")
    harness.push_tokens("r", [], finished=True, error_status="UNAVAILABLE", error="worker w0 lost", retry=True)
    await harness.submitted(2)
    assert harness.submits == [("r", []), ("r.1", [5, 6, 7])]
    assert harness.cancels == ["r"], "the lost attempt is cancelled wherever it may still run"
    harness.push_tokens("r", [99], worker_id="w0")  # late, from the lost attempt: never reaches the client
    harness.push_tokens("r.1", [8], worker_id="w1")
    harness.push_tokens("r.1", [9], worker_id="w1", finished=True, finish_reason="length")
    messages = await asyncio.wait_for(collecting, 5)
    assert [t for m in messages for t in m.token_ids] == [5, 6, 7, 8, 9]
    assert messages[-1].finished and stream.failovers == 1 and stream.worker_id == "w1"


@with_harness
async def test_a_request_lost_too_often_ends_unavailable(harness):
    stream = harness.stream()
    collecting = asyncio.create_task(_collect(stream))
    for attempt in ("r", "r.1", "r.2"):
        await harness.submitted(len(harness.submits) + 1 if attempt == "r" else len(harness.submits))
        while harness.submits[-1][0] != attempt:
            await asyncio.sleep(0.01)
        harness.push_tokens(attempt, [], finished=True, error_status="UNAVAILABLE", error="gone", retry=True)
    with pytest.raises(UnavailableError, match="lost with its worker 3 times"):
        await asyncio.wait_for(collecting, 5)


@with_harness
async def test_a_failure_of_the_request_itself_is_not_retried(harness):
    stream = harness.stream()
    collecting = asyncio.create_task(_collect(stream))
    await harness.submitted(1)
    harness.push_tokens("r", [], finished=True, error_status="FAILED_PRECONDITION", error="non-finite logits")
    with pytest.raises(Exception, match="non-finite logits") as info:
        await asyncio.wait_for(collecting, 5)
    assert info.value.status == "FAILED_PRECONDITION" and len(harness.submits) == 1


@with_harness
async def test_the_cluster_watch_fails_over_streams_of_a_worker_that_left(harness):
    streams = Streams(harness.config)
    placed, queued = harness.stream("p"), harness.stream("q")
    for s in (placed, queued):
        streams.add(s)
    tasks = [asyncio.create_task(_collect(s)) for s in (placed, queued)]
    await harness.submitted(2)
    harness.push_tokens("p", [1], worker_id="w0")
    while not placed.placed:
        await asyncio.sleep(0.01)
    asked = placed.placed_at + 10.0
    streams.on_cluster("scheduler-1", {"w0"}, True, asked)
    streams.on_cluster("scheduler-1", {"w1"}, True, asked + 0.1)  # w0 is gone
    await harness.submitted(3)
    assert harness.submits[-1] == ("p.1", [1]) and not queued.failovers
    for task in tasks:
        task.cancel()


@with_harness
async def test_after_a_scheduler_restart_requests_no_worker_took_are_submitted_again(harness):
    streams = Streams(harness.config)
    stream = harness.stream("q")
    streams.add(stream)
    task = asyncio.create_task(_collect(stream))
    await harness.submitted(1)
    streams.on_cluster("scheduler-1", {"w0"}, True, 100.0)
    harness.instance = "scheduler-2"
    streams.on_cluster("scheduler-2", set(), False, 101.0)  # no ready worker yet: wait
    await asyncio.sleep(0.1)
    assert len(harness.submits) == 1
    streams.on_cluster("scheduler-2", {"w0"}, True, 101.5)
    await harness.submitted(2)
    assert harness.submits[-1] == ("q.1", [])
    task.cancel()


def test_with_no_scheduler_past_the_grace_period_unplaced_requests_fail():
    with_harness(_no_scheduler)(FailoverConfig(scheduler_grace_s=1.0))


async def _no_scheduler(h: Harness) -> None:
    streams = Streams(h.config)
    stream = h.stream("q")
    streams.add(stream)
    task = asyncio.create_task(_collect(stream))
    await h.submitted(1)
    streams.on_scheduler_unreachable(10.0)
    streams.on_scheduler_unreachable(10.5)
    await asyncio.sleep(0.05)
    assert not task.done()
    streams.on_scheduler_unreachable(11.1)
    with pytest.raises(Exception, match="has not answered") as info:
        await asyncio.wait_for(task, 5)
    assert info.value.status == "UNAVAILABLE"


@with_harness
async def test_a_reader_cancelled_as_a_message_arrives_is_cancelled(harness):
    """Cancelling the reader (its client left) must end it whenever a message lands in the same loop
    turns: the message is never delivered in place of the cancellation. Every interleaving of the
    arrival and the cancel within a few loop turns is tried."""
    for ticks in range(6):
        stream = harness.stream(f"r{ticks}")
        reading = asyncio.create_task(_collect(stream))
        await harness.submitted(ticks + 1)
        harness.sink._deliver(Tokens(f"r{ticks}", [5], worker_id="w0"))  # what the sink's loop does with one
        for _ in range(ticks):
            await asyncio.sleep(0)
        reading.cancel()
        done, _ = await asyncio.wait([reading], timeout=2)
        assert done and reading.cancelled(), f"{ticks} turns: the cancel was swallowed, the reader reads on"


def test_an_attempt_that_makes_no_progress_ends_unavailable():
    @with_harness
    async def run(harness):
        stream = harness.stream()
        reading = asyncio.create_task(_collect(stream))
        await harness.submitted(1)
        harness.push_tokens("r", [5], worker_id="w0")  # then nothing more
        done, _ = await asyncio.wait([reading], timeout=3)
        assert done, "the silent attempt never timed out"
        with pytest.raises(UnavailableError, match="no progress for 0 s"):
            reading.result()

    run(FailoverConfig(max_failovers=2, inactivity_timeout_s=0.3))


def test_a_reader_slower_than_its_deadline_loses_nothing_while_tokens_arrive():
    """The deadline counts the time without messages, not the time the reader spends between them."""

    @with_harness
    async def run(harness):
        stream = harness.stream()
        tokens: list[int] = []

        async def slow_reader() -> None:
            async for message in stream.messages():
                tokens.extend(message.token_ids)
                await asyncio.sleep(0.25)  # a slow client: more than the deadline for the whole stream

        reading = asyncio.create_task(slow_reader())
        await harness.submitted(1)
        for token in range(8):
            harness.push_tokens("r", [token], worker_id="w0", finished=token == 7, finish_reason="length")
            await asyncio.sleep(0.05)
        await asyncio.wait_for(reading, 5)
        assert tokens == list(range(8))

    run(FailoverConfig(max_failovers=2, inactivity_timeout_s=0.2))
