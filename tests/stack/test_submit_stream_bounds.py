"""SubmitStream's bounds on both sides, against a real scheduler process and a worker speaking the real
protocol: a batch is at most MAX_SUBMIT_BATCH (256) entries and MAX_SUBMIT_BATCH_BYTES (8 MiB).

- The scheduler refuses a batch over either cap at once (INVALID_ARGUMENT naming the cap), however
  many entries it holds (50,000 held its event loop 5.8 s before), and keeps serving health checks and
  other Submits meanwhile and after.
- A full batch (256 entries) is taken SUBMIT_CHUNK (32) entries at a time, the event loop's other work
  in between: while 8 full batches stream in, health checks are answered within STALL_BOUND_S (before,
  the batches were taken back to back: 0.25-0.6 s without an answer).
- The gateway's outbox is split into writes under both caps (600 concurrent Submits: at least 3
  writes, none over 256), and a request that alone is larger than a write may be fails alone, at the
  gateway, with a message naming the cap; its neighbours are queued.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from scheduler_proc import scheduler_with_worker
from test_submit_stream import SINK, _request

from loraserve.errors import InvalidRequestError
from loraserve.gateway.submit_stream import SubmitStream
from loraserve.grpc_utils import CHANNEL_OPTIONS, internal_channel
from loraserve.v1 import scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.slow
MAX_SUBMIT_BATCH, MAX_SUBMIT_BATCH_BYTES = 256, 8 << 20  # the caps as documented (`loraserve/bounds.py`)
REFUSED_WITHIN_S = 2.0  # a 50,000-entry batch: sent, parsed and refused (5.8 s of a blocked loop before)
STALL_BOUND_S = 0.25  # the slowest health answer while full batches stream in (one chunk is ~4 ms of CPU)


@pytest.fixture
def scheduler():
    with scheduler_with_worker() as running:
        yield running


def _batch(prefix: str, count: int) -> scheduler_pb2.SubmitStreamRequest:
    template = _request("x")
    batch = scheduler_pb2.SubmitStreamRequest()
    for i in range(count):
        entry = batch.requests.add()
        entry.CopyFrom(template)
        entry.request_id = f"{prefix}{i}"
    return batch


class HealthProbe:
    """Health checks every 10 ms from a thread, each one's round trip kept."""

    def __init__(self, process):
        self.process = process
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            assert self.process.status(timeout=30) == health_pb2.HealthCheckResponse.SERVING
            self.latencies.append(time.monotonic() - started)
            time.sleep(0.01)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


def _stream_call(address: str, batches: list[scheduler_pb2.SubmitStreamRequest]):
    """Send `batches` on one SubmitStream call; (the answers, the error that ended it or None, seconds)."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        started = time.monotonic()
        answers, error = [], None
        try:
            for answer in stub.SubmitStream(iter(batches), timeout=120):
                answers.append(answer)
        except grpc.RpcError as e:
            error = e
        return answers, error, time.monotonic() - started
    finally:
        channel.close()


def test_a_batch_over_the_caps_is_refused_at_once_while_the_scheduler_keeps_serving(scheduler):
    process, worker = scheduler
    flood = _batch("flood", 50_000)
    with HealthProbe(process) as probe:
        answers, error, seconds = _stream_call(process.grpc_address, [flood])
        assert not answers and error is not None, f"{len(answers)} answers: the batch was taken"
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert f"at most {MAX_SUBMIT_BATCH}" in error.details() and "50000" in error.details()
        assert seconds < REFUSED_WITHIN_S, f"refused after {seconds:.2f} s"
        process.submit("after-flood", SINK)  # another caller is served at once
        worker.wait_assigned("after-flood")
        big = [_request(f"big{i}", prompt_ids=[2**31] * 700_000) for i in range(3)]  # ~3.5 MB each, 3 entries
        answers, error, _ = _stream_call(process.grpc_address, [scheduler_pb2.SubmitStreamRequest(requests=big)])
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert f"at most {MAX_SUBMIT_BATCH_BYTES}" in error.details()
    assert probe.latencies and max(probe.latencies) < 1.0, f"health answered in {max(probe.latencies):.3f} s"
    assert not any(a.spec.request_id.startswith(("flood", "big")) for a in worker.assigned)


def test_full_batches_do_not_stall_the_scheduler_loop(scheduler):
    process, worker = scheduler
    batches = [_batch(f"full{n}-", MAX_SUBMIT_BATCH) for n in range(8)]  # the queue takes 1024: refusals too
    with HealthProbe(process) as probe:
        time.sleep(0.2)  # the probe's first answers: the idle baseline
        idle = len(probe.latencies)
        answers, error, seconds = _stream_call(process.grpc_address, batches)
        time.sleep(0.1)
    assert error is None, error
    assert [len(a.outcomes) for a in answers] == [MAX_SUBMIT_BATCH] * len(batches)
    statuses = [o.status for a in answers for o in a.outcomes]
    assert set(statuses[:1024]) == {"OK"} and set(statuses) == {"OK", "RESOURCE_EXHAUSTED"}  # the queue's bound
    during = probe.latencies[idle:]
    assert during, "no health check ran while the batches were taken"
    worst = max(during)
    assert worst < STALL_BOUND_S, (
        f"health answered in up to {worst * 1000:.0f} ms (median {statistics.median(during) * 1000:.1f} ms) "
        f"while {len(batches)} full batches were taken in {seconds:.2f} s"
    )
    worker.wait_assigned("full0-0")


def test_the_gateway_splits_its_outbox_and_an_oversized_request_fails_alone(scheduler):
    process, worker = scheduler
    requests = [_request(f"r{i}") for i in range(600)]
    oversized = _request("oversized", prompt_ids=[2**31] * (MAX_SUBMIT_BATCH_BYTES // 5 + 1000))  # 5 bytes a token

    async def run() -> tuple[list, SubmitStream]:
        channel = internal_channel(process.grpc_address)
        stream = SubmitStream(scheduler_pb2_grpc.SchedulerStub(channel), timeout_s=60.0)
        try:
            everything = [*requests[:300], oversized, *requests[300:]]
            outcomes = await asyncio.gather(*(stream.submit(r) for r in everything), return_exceptions=True)
            return outcomes, stream
        finally:
            await stream.close()
            await channel.close()

    outcomes, stream = asyncio.run(run())
    refused = outcomes.pop(300)
    assert not [o for o in outcomes if isinstance(o, Exception)], "a neighbour of the oversized request failed"
    assert stream.batches >= 3, f"600 concurrent submits went in {stream.batches} writes"
    assert stream.largest <= MAX_SUBMIT_BATCH, f"a write of {stream.largest} entries"
    assert isinstance(refused, InvalidRequestError) and refused.status == "INVALID_ARGUMENT", refused
    assert f"more than one submit may carry ({MAX_SUBMIT_BATCH_BYTES})" in str(refused)
    worker.wait_assigned("r0")
