"""The scheduler's gRPC control plane: Submit, Cancel, GetClusterState, PrepareAdapter, and SubmitStream
(Submits and hints batched on one call: what gateways use).

A SubmitStream batch is bounded (`loraserve/bounds.py`: 256 entries, 8 MiB): a larger one ends the call
INVALID_ARGUMENT before any of it is looked at (`check_batch`). An allowed batch is taken SUBMIT_CHUNK
entries at a time, the event loop's other work (worker reports, other gateways' calls, health) getting a
turn between chunks, so a full batch never holds the loop for more than one chunk's worth (~2-4 ms on the
development CPU).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator

import grpc

from loraserve.errors import LoraserveError, UnavailableError
from loraserve.grpc_utils import RETRY_AFTER_KEY, code_and_message
from loraserve.scheduler.cluster_state import cluster_state
from loraserve.scheduler.loop import SchedulerLoop
from loraserve.scheduler.quotas import QuotaExceededError
from loraserve.scheduler.submit import check_batch, spec_from_submit
from loraserve.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)
SUBMIT_CHUNK = 32  # a batch's entries taken before the event loop's other work gets a turn


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    """The scheduler's gRPC control plane: each call goes straight to the `SchedulerLoop`."""

    def __init__(self, loop: SchedulerLoop):
        self.loop = loop
        self.stopping = False  # set as the scheduler stops: its open SubmitStream calls take nothing more

    async def Submit(self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext):
        try:
            return self._submit(request, context.invocation_metadata())
        except QuotaExceededError as e:  # the gateway passes the hint on to its client
            if e.retry_after_s is not None:
                context.set_trailing_metadata(((RETRY_AFTER_KEY, str(_retry_after_ms(e))),))
            raise

    async def SubmitStream(self, batches: AsyncIterator[scheduler_pb2.SubmitStreamRequest], context):
        """Each batch's hints, then its requests, each answered with the outcome Submit would have had."""
        async for batch in batches:
            if self.stopping:  # the gateway fails what waits on this call UNAVAILABLE, and submits elsewhere
                raise UnavailableError("the scheduler is stopping")
            check_batch(batch)
            taken = 0
            for hint in batch.hints:
                self._hint(hint)
                taken = await _turn(taken)
            outcomes = []
            for request in batch.requests:
                outcomes.append(self._outcome(request))
                taken = await _turn(taken)
            yield scheduler_pb2.SubmitStreamResponse(outcomes=outcomes)

    def _submit(self, request: scheduler_pb2.SubmitRequest, trace_context) -> scheduler_pb2.SubmitResponse:
        spec = spec_from_submit(request, time.time())  # the request's one record from here on
        position = self.loop.submit(spec, request.tokens_per_minute, trace_context, request.request_cost)
        return scheduler_pb2.SubmitResponse(queue_position=position, instance=self.loop.instance)

    def _outcome(self, request: scheduler_pb2.SubmitRequest) -> scheduler_pb2.SubmitOutcome:
        try:
            queued = self._submit(request, request.trace_context)
        except Exception as e:  # one request's refusal (or failure) is its own outcome, not the call's
            code, message = code_and_message(e)
            retry_ms = _retry_after_ms(e) if isinstance(e, QuotaExceededError) else 0
            return scheduler_pb2.SubmitOutcome(
                request_id=request.request_id, status=code.name, message=message, retry_after_ms=retry_ms
            )
        return scheduler_pb2.SubmitOutcome(request_id=request.request_id, status="OK", queued=queued)

    def _hint(self, hint: scheduler_pb2.PrepareAdapterRequest) -> None:
        try:
            self.loop.prepare_adapter(hint, hint.trace_context)
        except LoraserveError as e:  # a hint is best effort: a bad one changes nothing
            log.debug("adapter hint for %r not taken: %s", hint.adapter, e)
        except Exception:  # nor may a failing one end the call the gateway's Submits share
            log.exception("adapter hint for %r failed", hint.adapter)

    async def Cancel(self, request: scheduler_pb2.CancelRequest, context: grpc.aio.ServicerContext):
        return scheduler_pb2.CancelResponse(found=self.loop.cancel(request.request_id, request.reason))

    async def GetClusterState(self, request, context: grpc.aio.ServicerContext):
        return cluster_state(self.loop.policy, self.loop.instance)

    async def PrepareAdapter(self, request: scheduler_pb2.PrepareAdapterRequest, context: grpc.aio.ServicerContext):
        worker_id = self.loop.prepare_adapter(request, context.invocation_metadata())
        return scheduler_pb2.PrepareAdapterResponse(worker_id=worker_id)


async def _turn(taken: int) -> int:
    """Count one more entry of a batch taken; after every SUBMIT_CHUNK, let the event loop run its other work."""
    taken += 1
    if taken % SUBMIT_CHUNK == 0:
        await asyncio.sleep(0)
    return taken


def _retry_after_ms(refusal: QuotaExceededError) -> int:
    """A quota refusal's retry hint in whole milliseconds (0: none)."""
    return math.ceil(refusal.retry_after_s * 1000) if refusal.retry_after_s is not None else 0
