"""The gateway's SubmitStream client (`gateway/submit_stream.py`) against a real scheduler process and a
worker speaking the real protocol: concurrent Submits share batches and each gets its own outcome, a
refusal stays with its request, a quota refusal keeps its retry hint, hints reach a worker with their
trace, and a scheduler that goes away fails what waits UNAVAILABLE at once; the next Submit opens a
new call to its successor."""

from __future__ import annotations

import asyncio
import signal
import time

import msgspec
import pytest
from scheduler_proc import SchedulerProcess, scheduler_with_worker

from loraserve.errors import UnavailableError
from loraserve.gateway.events import RetryLaterError
from loraserve.gateway.submit_stream import SubmitStream
from loraserve.grpc_utils import internal_channel
from loraserve.params import SamplingParams, encode_sampling
from loraserve.v1 import scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.slow
SINK = "tcp://127.0.0.1:9"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def scheduler():
    with scheduler_with_worker() as running:
        yield running


def _request(request_id: str, **fields) -> scheduler_pb2.SubmitRequest:
    fields = {"prompt_ids": [1, 2, 3], "sampling_params": encode_sampling(SamplingParams(max_new_tokens=4))} | fields
    return scheduler_pb2.SubmitRequest(request_id=request_id, reply_to=SINK, arrival_unix=time.time(), **fields)


async def _outcomes(stream: SubmitStream, requests: list[scheduler_pb2.SubmitRequest]) -> list:
    return await asyncio.gather(*(stream.submit(r) for r in requests), return_exceptions=True)


def test_concurrent_submits_share_batches_and_a_refusal_stays_with_its_request(scheduler):
    process, worker = scheduler
    requests = [_request(f"r{i}") for i in range(60)]  # within the fake worker's 64 slots
    requests[17] = _request("bad-sampling", sampling_params=msgspec.msgpack.encode({"top_p": 0.0}))
    requests[40] = _request("bad-prompt", prompt_ids=[])

    async def run() -> tuple[list, int]:
        channel = internal_channel(process.grpc_address)
        stream = SubmitStream(scheduler_pb2_grpc.SchedulerStub(channel), timeout_s=10.0)
        try:
            return await _outcomes(stream, requests), stream.batches
        finally:
            await stream.close()
            await channel.close()

    outcomes, batches = asyncio.run(run())
    refused = {r.request_id: o for r, o in zip(requests, outcomes, strict=True) if isinstance(o, Exception)}
    assert set(refused) == {"bad-sampling", "bad-prompt"}, refused
    assert refused["bad-sampling"].status == "INVALID_ARGUMENT" and "top_p" in str(refused["bad-sampling"])
    assert refused["bad-prompt"].status == "INVALID_ARGUMENT" and "prompt_ids" in str(refused["bad-prompt"])
    instance = process.stub.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=5).instance
    assert all(o.instance == instance for o in outcomes if not isinstance(o, Exception))
    assert batches < len(requests) / 4, f"{batches} writes for {len(requests)} concurrent submits"
    for request in requests:
        if request.request_id not in refused:
            assert worker.wait_assigned(request.request_id).spec.sampling == SamplingParams(max_new_tokens=4)


def test_a_quota_refusal_keeps_its_retry_hint_and_a_hint_reaches_a_worker_with_its_trace(scheduler):
    process, worker = scheduler
    # 7 tokens each (3 prompt + 4 new) against 10 a minute: the second is refused until tokens come back
    first, second = (_request(name, tenant="acme", tokens_per_minute=10) for name in ("q1", "q2"))
    hint = scheduler_pb2.PrepareAdapterRequest(adapter="style", adapter_version=3, tenant="acme")
    hint.trace_context["traceparent"] = TRACEPARENT

    async def run() -> list:
        channel = internal_channel(process.grpc_address)
        stream = SubmitStream(scheduler_pb2_grpc.SchedulerStub(channel), timeout_s=10.0)
        try:
            stream.hint(hint)
            return [await stream.submit(first), *(await _outcomes(stream, [second]))]
        finally:
            await stream.close()
            await channel.close()

    queued, refusal = asyncio.run(run())
    assert queued.instance
    assert isinstance(refusal, RetryLaterError) and refusal.retry_after_ms > 0, refusal
    deadline = time.monotonic() + 5
    while not worker.prefetched and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p.adapters for p in worker.prefetched] == [[("style", 3)]]
    assert worker.prefetched[0].trace["traceparent"].split("-")[1] == TRACEPARENT.split("-")[1]


def test_a_scheduler_that_goes_away_fails_waiting_submits_at_once_and_its_successor_is_used(scheduler):
    process, _ = scheduler

    async def run() -> None:
        channel = internal_channel(process.grpc_address)
        stream = SubmitStream(scheduler_pb2_grpc.SchedulerStub(channel), timeout_s=30.0)
        successor = None
        try:
            await stream.submit(_request("before"))
            process.process.send_signal(signal.SIGKILL)
            process.process.wait(10)
            started = time.monotonic()
            with pytest.raises(UnavailableError, match="the scheduler is unavailable"):
                await stream.submit(_request("while-gone"))
            assert time.monotonic() - started < 10, "a submit waited for its timeout, not for the call's end"
            successor = SchedulerProcess(worker_timeout=5.0, base_port=process.base_port)
            await asyncio.to_thread(successor.wait_serving)
            for _ in range(100):  # the channel reconnects (backoff capped at 1 s); each try opens a new call
                try:
                    queued = await stream.submit(_request("after"))
                    break
                except UnavailableError:
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError("no submit reached the restarted scheduler")
            state = successor.stub.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=5)
            assert queued.instance == state.instance
        finally:
            await stream.close()
            await channel.close()
            if successor is not None:
                successor.stop()

    asyncio.run(run())
