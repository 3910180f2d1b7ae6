"""The gateway's side of a client request of several generations (`gateway/client_request.py`): every
generation waits for the others' token costs and submits with their sum; one that fails first releases
the others with a failure. And the byte arithmetic the SubmitStream outbox splits its writes by
(`gateway/submit_stream.py`), against protobuf's own."""

from __future__ import annotations

import asyncio

import pytest

from loraserve.errors import InvalidRequestError
from loraserve.gateway.client_request import AbandonedError, ClientRequest
from loraserve.gateway.submit_stream import entry_bytes
from loraserve.v1 import scheduler_pb2


def test_every_generation_gets_the_sum_of_all_costs_once_all_reported():
    async def run() -> list[int]:
        request = ClientRequest("cmpl-1", 3)
        first = asyncio.create_task(request.cost_of_all(10))
        await asyncio.sleep(0.01)
        assert not first.done()  # the others' costs are not known yet
        rest = await asyncio.gather(request.cost_of_all(20), request.cost_of_all(30))
        return [await first, *rest]

    assert asyncio.run(run()) == [60, 60, 60]


def test_a_generation_that_fails_first_releases_the_others_with_its_failure():
    async def run() -> None:
        request = ClientRequest("cmpl-2", 3)
        waiting = asyncio.create_task(request.cost_of_all(10))
        await asyncio.sleep(0)
        refusal = InvalidRequestError("prompt", "4000 tokens do not fit the context length 512")
        request.abandon(refusal)  # refused at validation: it will never report
        with pytest.raises(InvalidRequestError) as info:  # the request fails whole, with the same status
            await waiting
        assert info.value is refusal
        with pytest.raises(InvalidRequestError):  # and one that comes later does not wait either
            await request.cost_of_all(10)
        request.abandon(asyncio.CancelledError())  # a second failure changes nothing

        cancelled = ClientRequest("cmpl-3", 2)
        cancelled.abandon(asyncio.CancelledError())  # the client went away: not a LoraserveError
        with pytest.raises(AbandonedError, match="another generation") as gone:
            await cancelled.cost_of_all(10)
        assert gone.value.status == "CANCELLED"

    asyncio.run(run())


def test_a_cancelled_waiter_does_not_cancel_the_others():
    async def run() -> int:
        request = ClientRequest("cmpl-4", 2)
        one = asyncio.create_task(request.cost_of_all(5))
        await asyncio.sleep(0)  # it reported its cost, and waits
        one.cancel()
        await asyncio.gather(one, return_exceptions=True)
        return await asyncio.wait_for(request.cost_of_all(7), 5)

    assert asyncio.run(run()) == 12


def test_entry_bytes_is_what_an_entry_adds_to_a_batch():
    for prompt_len in (0, 1, 40, 200, 20_000, 3_000_000):
        request = scheduler_pb2.SubmitRequest(request_id="r", prompt_ids=[70_000] * prompt_len, tenant="t")
        hint = scheduler_pb2.PrepareAdapterRequest(adapter="a" * (prompt_len % 300))
        batch = scheduler_pb2.SubmitStreamRequest(requests=[request, request], hints=[hint])
        expected = 2 * entry_bytes(request.ByteSize()) + entry_bytes(hint.ByteSize())
        assert batch.ByteSize() == expected
