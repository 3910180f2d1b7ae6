"""The gRPC generation RPCs, `Generate` and `GenerateStream`: a thin adapter over the generation core.

A `GenerateRequest` is mapped to a generation's fields (`grpc_fields`, read by the core after admission,
which parses them), the core's events are written as `GenerateStreamResponse`s (or gathered into one
`GenerateResponse`), and a refusal with a retry hint sends it as trailing metadata `retry-after-ms`
before its status. The call's deadline travels with the request; a cancelled call closes the core's
generation, which cancels it downstream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

import grpc

from loraserve.convert import FINISH_REASONS
from loraserve.gateway.core import Call, GenerationCore
from loraserve.gateway.events import Chunk, Event, Logprob, RetryLaterError, Summary
from loraserve.gateway.generation_request import grpc_fields
from loraserve.gateway.grpc_calls import deadline_of, metadata_of
from loraserve.grpc_utils import RETRY_AFTER_KEY
from loraserve.v1 import common_pb2, gateway_pb2


class GenerationService:
    """`Generate` and `GenerateStream` of `loraserve.v1.LoraServe`."""

    def __init__(self, core: GenerationCore):
        self.core = core

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        text, tokens, logprobs, prompt_logprobs, summary = [], [], [], [], None
        events = self._events(request, context)
        try:
            async for event in events:
                if isinstance(event, Chunk):
                    text.append(event.text)
                    tokens += event.token_ids
                    logprobs += event.logprobs
                    prompt_logprobs += event.prompt_logprobs
                else:
                    summary = event
        except RetryLaterError as e:
            _retry_after(context, e)
            raise
        finally:
            await events.aclose()
        response = summary_to_pb(summary)
        response.text = "".join(text)
        response.token_ids.extend(tokens)
        response.logprobs.extend(map(logprob_to_pb, logprobs))
        response.prompt_logprobs.extend(map(logprob_to_pb, prompt_logprobs))
        return response

    async def GenerateStream(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        events = self._events(request, context)
        try:
            async for event in events:
                if isinstance(event, Chunk):
                    yield gateway_pb2.GenerateStreamResponse(chunk=chunk_to_pb(event))
                else:
                    yield gateway_pb2.GenerateStreamResponse(summary=summary_to_pb(event))
        except RetryLaterError as e:
            _retry_after(context, e)
            raise
        finally:
            await events.aclose()

    def _events(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[Event]:
        """The core's generation of `request` (the caller closes it)."""
        call = Call(metadata_of(context), deadline_of(context), request.client_request_id)
        return self.core.generate(call, partial(grpc_fields, request))


def _retry_after(context: grpc.aio.ServicerContext, refusal: RetryLaterError) -> None:
    """The refusal's retry hint, as trailing metadata sent before its status."""
    context.set_trailing_metadata(((RETRY_AFTER_KEY, str(refusal.retry_after_ms)),))


def chunk_to_pb(chunk: Chunk) -> gateway_pb2.TokenChunk:
    return gateway_pb2.TokenChunk(
        text=chunk.text,
        token_ids=chunk.token_ids,
        logprobs=map(logprob_to_pb, chunk.logprobs),
        prompt_logprobs=map(logprob_to_pb, chunk.prompt_logprobs),
    )


def summary_to_pb(summary: Summary) -> gateway_pb2.GenerateResponse:
    t = summary.timings
    return gateway_pb2.GenerateResponse(
        request_id=summary.request_id,
        client_request_id=summary.client_request_id,
        finish_reason=FINISH_REASONS.get(summary.finish_reason, common_pb2.FINISH_REASON_UNSPECIFIED),
        usage=common_pb2.Usage(
            prompt_tokens=summary.prompt_tokens,
            completion_tokens=summary.completion_tokens,
            cached_tokens=summary.cached_tokens,
        ),
        timings=common_pb2.Timings(
            queue_s=t.queue_s,
            adapter_load_s=t.adapter_load_s,
            prefill_s=t.prefill_s,
            time_to_first_token_s=t.time_to_first_token_s,
            decode_s=t.decode_s,
            total_s=t.total_s,
        ),
        adapter_version=summary.adapter_version,
        worker_id=summary.worker_id,
        failovers=summary.failovers,
    )


def logprob_to_pb(entry: Logprob) -> common_pb2.TokenLogprob:
    top = [common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in entry.top]
    if entry.logprob is None:
        return common_pb2.TokenLogprob(token_id=entry.token_id, top=top)
    return common_pb2.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob, top=top)
