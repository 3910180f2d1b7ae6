"""The scheduler's SubmitStream servicer (`scheduler/service.py`) on a real `SchedulerLoop`, in this
process: a batch over the caps is refused before any of it is taken, and a full batch is taken in
chunks of SUBMIT_CHUNK entries with the event loop's other work running in between."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import pytest
from scheduler_proc import report

from loraserve.errors import InvalidRequestError
from loraserve.params import SamplingParams, encode_sampling
from loraserve.scheduler.loop import SchedulerLoop
from loraserve.scheduler.policy import PolicyConfig, SchedulerPolicy
from loraserve.scheduler.service import SchedulerService
from loraserve.v1 import scheduler_pb2

MAX_SUBMIT_BATCH, MAX_SUBMIT_BATCH_BYTES, SUBMIT_CHUNK = 256, 8 << 20, 32  # as documented


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(count: int, prompt_len: int = 3) -> scheduler_pb2.SubmitStreamRequest:
    batch = scheduler_pb2.SubmitStreamRequest()
    sampling = encode_sampling(SamplingParams(max_new_tokens=4))
    for i in range(count):
        batch.requests.add(
            request_id=f"r{i}",
            prompt_ids=[2**31] * prompt_len,
            sampling_params=sampling,
            reply_to="tcp://127.0.0.1:9",
            arrival_unix=time.time(),
        )
    return batch


async def _one(batch: scheduler_pb2.SubmitStreamRequest) -> AsyncIterator[scheduler_pb2.SubmitStreamRequest]:
    yield batch


def test_the_caps_are_what_the_docs_say():
    from loraserve import bounds
    from loraserve.scheduler import service

    assert (bounds.MAX_SUBMIT_BATCH, bounds.MAX_SUBMIT_BATCH_BYTES) == (MAX_SUBMIT_BATCH, MAX_SUBMIT_BATCH_BYTES)
    assert service.SUBMIT_CHUNK == SUBMIT_CHUNK


def test_a_batch_over_a_cap_is_refused_whole_and_a_full_one_yields_to_the_loop_between_chunks():
    async def scenario() -> tuple[int, float, list[str]]:
        policy = SchedulerPolicy(PolicyConfig.of(worker_timeout_s=60.0, stale_after_s=60.0))
        loop = SchedulerLoop(policy, f"tcp://127.0.0.1:{_free_port()}")
        try:
            policy.on_report(report("w", max_batch_size=64), time.time())
            service = SchedulerService(loop)
            for over in (_batch(MAX_SUBMIT_BATCH + 1), _batch(3, prompt_len=MAX_SUBMIT_BATCH_BYTES // 10)):
                with pytest.raises(InvalidRequestError, match="a batch may"):
                    [answer async for answer in service.SubmitStream(_one(over), None)]
            assert not loop.pending, "a refused batch queued requests"

            turns, gaps, last = 0, [], time.perf_counter()

            async def other_work() -> None:  # what else the loop serves: worker reports, other gateways
                nonlocal turns, last
                while True:
                    await asyncio.sleep(0)
                    now = time.perf_counter()
                    turns, gaps[:], last = turns + 1, [*gaps, now - last], now

            ticker = asyncio.create_task(other_work())
            await asyncio.sleep(0)
            turns, gaps[:] = 0, []
            answers = [answer async for answer in service.SubmitStream(_one(_batch(MAX_SUBMIT_BATCH)), None)]
            ticker.cancel()
            statuses = [o.status for answer in answers for o in answer.outcomes]
            return turns, max(gaps), statuses
        finally:
            loop.close()

    turns, longest_gap, statuses = asyncio.run(scenario())
    assert statuses == ["OK"] * MAX_SUBMIT_BATCH
    assert turns >= MAX_SUBMIT_BATCH // SUBMIT_CHUNK - 1, f"the loop ran other work {turns} times during the batch"
    assert longest_gap < 0.25, f"the loop was held {longest_gap * 1000:.0f} ms at once"
