"""The gateway's calls to the scheduler: submit an attempt, cancel one, hint an adapter. Plain values
in; the protobufs are built here and nowhere else in the generation path.

Submits and hints travel batched on one SubmitStream call (`gateway/submit_stream.py`): a unary call
each cost the scheduler several times more CPU per request. Hints and cancels are fire and forget: a
cancel runs in a task this client keeps until it ends, and a failure is only logged. A Submit refused
RESOURCE_EXHAUSTED with a retry hint (the scheduler's token quota) is raised as `RetryLaterError`
carrying that hint.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from loraserve import telemetry
from loraserve.gateway.adapter_versions import AdapterVersion
from loraserve.gateway.generation_request import GenerationRequest
from loraserve.gateway.submit_stream import SubmitStream
from loraserve.names import TENANT_NAME
from loraserve.request_spec import encode_spec
from loraserve.v1 import scheduler_pb2
from loraserve.v1 import scheduler_pb2_grpc as sched_grpc

log = logging.getLogger(__name__)


class SchedulerClient:
    """Submit, Cancel and PrepareAdapter, each with the internal timeout; tokens come back to `reply_to`."""

    def __init__(self, stub: sched_grpc.SchedulerStub, reply_to: str, timeout_s: float):
        self.stub, self.reply_to, self.timeout_s = stub, reply_to, timeout_s
        self.stream = SubmitStream(stub, timeout_s)  # Submits and hints, batched on one call
        self._background: set[asyncio.Task] = set()

    async def submit(
        self,
        attempt_id: str,
        attempt: int,
        output_ids: list[int],
        *,
        valid: GenerationRequest,
        prompt_ids: list[int],
        version: AdapterVersion,
        arrival_unix: float,
        deadline_unix: float | None,
        tenant: str,
        tokens_per_minute: int,
        request_key: str = "",
        request_cost: int = 0,
    ) -> str:
        """Queue one attempt of a generation (`output_ids`: the tokens its lost predecessors streamed);
        returns the instance of the scheduler that took it. `request_key`: the client request it is a
        generation of (an HTTP body's; "": its prefill group, if any), which the scheduler counts batch
        slots by; `request_cost`: that request's whole token cost, charged once (0: this one alone)."""
        spec = valid.to_spec(
            attempt_id,
            prompt_ids,
            version,
            reply_to=self.reply_to,
            arrival=arrival_unix,
            deadline=deadline_unix,
            tenant=tenant,
            attempt=attempt,
            output_ids=output_ids,
            request_key=request_key,
        )
        submit = scheduler_pb2.SubmitRequest(
            request_id=attempt_id,
            spec=encode_spec(spec),  # the scheduler decodes it, which checks it, and carries it to the worker
            tokens_per_minute=tokens_per_minute,
            request_cost=request_cost,
        )
        with telemetry.tracer().start_as_current_span("gateway.submit"):
            submit.trace_context.update(telemetry.carrier())  # the batch has no per-request metadata
            response = await self.stream.submit(submit)
        return response.instance

    def hint(self, adapter: str, version: AdapterVersion, tenant: str) -> None:
        """Tell the scheduler, without waiting, that a request for this adapter version follows: the worker it
        would go to starts fetching the adapter now (`scheduler/hints.py`). A hint that fails changes nothing."""
        hint = scheduler_pb2.PrepareAdapterRequest(
            adapter=adapter,
            adapter_version=version.version,
            adapter_sha256=version.sha256,
            adapter_rank=version.rank,
            tenant=tenant if TENANT_NAME.fullmatch(tenant) else "",
        )
        hint.trace_context.update(telemetry.carrier())  # the request's trace: the worker's fetch and the store join it
        self.stream.hint(hint)

    def cancel(self, request_id: str, reason: str) -> None:
        """Cancel an attempt downstream, without waiting."""

        async def cancel() -> None:
            try:
                await self.stub.Cancel(
                    scheduler_pb2.CancelRequest(request_id=request_id, reason=reason), timeout=self.timeout_s
                )
            except grpc.aio.AioRpcError as e:
                log.warning("could not cancel %s downstream: %s", request_id, e.details())

        self._in_background(cancel)

    async def close(self) -> None:
        """End the SubmitStream call (Submits still waiting on it fail UNAVAILABLE)."""
        await self.stream.close()

    def _in_background(self, work: Callable[[], Awaitable[None]]) -> None:
        task = asyncio.get_running_loop().create_task(work())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
