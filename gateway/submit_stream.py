"""The gateway's one SubmitStream call to the scheduler: its Submits and hints, batched per write.

`submit` puts a request in the outbox and waits for its outcome; `hint` puts a hint there and does
not wait. The call's request iterator hands over what the outbox holds as one SubmitStreamRequest as
soon as the previous one is written: one request when the gateway is idle, many under load, never a
wait for a batch to fill. A write holds at most MAX_SUBMIT_BATCH entries (hints first, then requests,
in order) and MAX_SUBMIT_BATCH_BYTES encoded (`loraserve/bounds.py`: what the scheduler accepts); the
rest goes with the next writes. A request that alone is larger than a write may be is refused at once
(INVALID_ARGUMENT), before it joins the outbox: it fails alone, never its neighbours. A reader
resolves each outcome by request id; each is what the unary Submit would have ended with (queued, or
a refusal with its status and retry hint).

The call opens on first use, and again on the next use after it ended. When it ends (the scheduler
restarted, went away or refused the call), every request waiting for its outcome fails with
UNAVAILABLE, as unary Submits in flight to a scheduler that went away do, and the failover stream
resubmits where it would have (`gateway/failover.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator

import grpc

from loraserve.bounds import MAX_SUBMIT_BATCH, MAX_SUBMIT_BATCH_BYTES
from loraserve.errors import InvalidRequestError, LoraserveError, UnavailableError, error_for_status
from loraserve.gateway.events import RetryLaterError
from loraserve.v1 import scheduler_pb2

log = logging.getLogger(__name__)


class SubmitStream:
    """Submits and hints to one scheduler over one long-lived SubmitStream call."""

    def __init__(self, stub, timeout_s: float):
        self.stub, self.timeout_s = stub, timeout_s
        # the outbox, sent with the next writes: (message, its bytes in a SubmitStreamRequest)
        self._requests: deque[tuple[scheduler_pb2.SubmitRequest, int]] = deque()
        self._hints: deque[tuple[scheduler_pb2.PrepareAdapterRequest, int]] = deque()
        self._waiting: dict[str, asyncio.Future[scheduler_pb2.SubmitOutcome]] = {}  # by request id
        self._ready = asyncio.Event()  # the outbox holds something
        self._call_task: asyncio.Task | None = None
        self.batches = 0  # SubmitStreamRequests written (the batching is visible to tests and benchmarks)
        self.largest = 0  # the most entries (requests and hints) one of them held

    async def submit(self, request: scheduler_pb2.SubmitRequest) -> scheduler_pb2.SubmitResponse:
        """Queue `request` at the scheduler: where it was queued, or the refusal as the unary Submit's
        LoraserveError (a quota's retry hint as RetryLaterError). UNAVAILABLE if the call ends first, or
        no outcome comes within the timeout."""
        request_id = request.request_id
        if request_id in self._waiting:
            raise LoraserveError(f"request {request_id!r} is already being submitted")
        size = entry_bytes(request.ByteSize())
        if size > MAX_SUBMIT_BATCH_BYTES:
            raise InvalidRequestError(
                "request",
                f"is {size} bytes once encoded for the scheduler, more than one submit may carry "
                f"({MAX_SUBMIT_BATCH_BYTES}): shorten the prompt or the structured-output constraint",
            )
        outcome_of = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = outcome_of
        self._requests.append((request, size))
        self._send()
        try:
            async with asyncio.timeout(self.timeout_s):
                outcome = await outcome_of
        except TimeoutError:
            raise UnavailableError(f"the scheduler did not answer within {self.timeout_s:g} s") from None
        finally:
            self._waiting.pop(request_id, None)
        if outcome.status == "OK":
            return outcome.queued
        if outcome.status == "RESOURCE_EXHAUSTED" and outcome.retry_after_ms:
            raise RetryLaterError(outcome.message, outcome.retry_after_ms)
        raise error_for_status(outcome.status, outcome.message)

    def hint(self, hint: scheduler_pb2.PrepareAdapterRequest) -> None:
        """Send `hint` with the next write; nothing comes back."""
        self._hints.append((hint, entry_bytes(hint.ByteSize())))
        self._send()

    async def close(self) -> None:
        """End the call; Submits still waiting on it fail UNAVAILABLE."""
        if self._call_task is not None:
            self._call_task.cancel()
            await asyncio.gather(self._call_task, return_exceptions=True)
        self._fail_all(UnavailableError("the gateway is stopping"))

    def _send(self) -> None:
        self._ready.set()
        if self._call_task is None or self._call_task.done():
            self._call_task = asyncio.get_running_loop().create_task(self._run_call())

    async def _run_call(self) -> None:
        """One call, from its first batch to its end; then whatever still waits fails."""
        call = self.stub.SubmitStream(self._batches())
        why = "the scheduler ended the submit stream"
        try:
            async for reply in call:
                for outcome in reply.outcomes:
                    waiting = self._waiting.get(outcome.request_id)
                    if waiting is not None and not waiting.done():
                        waiting.set_result(outcome)
        except grpc.aio.AioRpcError as e:
            why = f"{e.code().name}: {e.details()}" if e.details() else e.code().name
        finally:
            call.cancel()
        log.info("submit stream to the scheduler ended (%s)", why)
        self._fail_all(UnavailableError(f"the scheduler is unavailable ({why})"))

    async def _batches(self) -> AsyncIterator[scheduler_pb2.SubmitStreamRequest]:
        """What the outbox holds, one batch per write under the caps (grpc asks for the next once the last
        is written); what does not fit stays for the next."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            hints, requests = self._take()
            if self._hints or self._requests:
                self._ready.set()  # more than one write's worth
            if requests or hints:
                self.batches += 1
                self.largest = max(self.largest, len(requests) + len(hints))
                yield scheduler_pb2.SubmitStreamRequest(requests=requests, hints=hints)

    def _take(self) -> tuple[list[scheduler_pb2.PrepareAdapterRequest], list[scheduler_pb2.SubmitRequest]]:
        """The outbox's oldest hints, then requests, up to MAX_SUBMIT_BATCH of them and MAX_SUBMIT_BATCH_BYTES
        (requests whose submit timed out meanwhile are dropped)."""
        hints: list[scheduler_pb2.PrepareAdapterRequest] = []
        requests: list[scheduler_pb2.SubmitRequest] = []
        room = MAX_SUBMIT_BATCH_BYTES
        for outbox, taken in ((self._hints, hints), (self._requests, requests)):
            while outbox and len(hints) + len(requests) < MAX_SUBMIT_BATCH and outbox[0][1] <= room:
                message, size = outbox.popleft()
                if taken is requests and message.request_id not in self._waiting:
                    continue
                taken.append(message)
                room -= size
            if outbox:  # full: the rest goes next, in order
                break
        return hints, requests

    def _fail_all(self, error: Exception) -> None:
        """End every submit still waiting, written or not: their call is over (the next submit opens one)."""
        self._requests.clear()
        self._hints.clear()
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(error)


def entry_bytes(size: int) -> int:
    """The bytes a message of `size` bytes takes as an entry of a SubmitStreamRequest's repeated field: its
    tag (one byte) and its length (a varint) before it."""
    return size + 1 + max(1, (size.bit_length() + 6) // 7)
