"""The generation core: one generation from a call's metadata and its request to a stream of events.

A generation: authenticate (`Gate`) → take one of the tenant's slots (`TenantSlots`) → validate the
request in the caller's namespace (INVALID_ARGUMENT naming the field) → compile its output constraint,
if any, in the sandbox processes (`constraints.py`; refused: INVALID_ARGUMENT) → resolve the adapter's
current version (the store-fed cache, else the store: NOT_FOUND) and hint it to the scheduler →
tokenize (in a tokenizer thread, `tokenizing.py`; a text too long to fit is refused first) → submit
to the scheduler (RESOURCE_EXHAUSTED, UNAVAILABLE) → read tokens from the sink and turn them into
`Chunk`s (`Output`) → a `Summary`. A generation closed early (the client
cancelled, its deadline passed, the edge stopped reading) is cancelled downstream at once; a worker
lost mid-stream is replaced without the client noticing (`FailoverStream`).

Plain Python: the edges (`gateway/service.py` for gRPC, `gateway/http/` for HTTP) map their requests
to a `GenerationRequest`'s fields and the events back into their own shapes. The fields are parsed
into the request here, after admission (`generation_request.parse`), so every edge refuses in the same
order. Failures are raised as
`LoraserveError`s (`RetryLaterError` with a retry hint).

State owned here: the live generations (`streams`, which the cluster watch reports to), the
tenants' generation slots (`slots`) and the count of ready workers the cluster watch last saw.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

import msgspec
from opentelemetry import trace

from loraserve import telemetry
from loraserve.errors import LoraserveError
from loraserve.gateway import metrics
from loraserve.gateway.adapter_versions import AdapterVersion
from loraserve.gateway.auth import Principal
from loraserve.gateway.client_request import ClientRequest
from loraserve.gateway.config import GatewayConfig
from loraserve.gateway.constraints import ConstraintSandbox, TokenizerSpec
from loraserve.gateway.events import Chunk, Event, Summary
from loraserve.gateway.failover import FailoverStream, Streams, Submit
from loraserve.gateway.gate import Gate
from loraserve.gateway.generation_request import MAX_CLIENT_ID, Fields, GenerationRequest, parse
from loraserve.gateway.namespaces import Namespace
from loraserve.gateway.output import Output, Step
from loraserve.gateway.scheduler_client import SchedulerClient
from loraserve.gateway.slots import TenantSlots
from loraserve.gateway.tenant_adapters import TenantAdapters
from loraserve.gateway.tenants import Scope
from loraserve.gateway.token_sink import TokenSink
from loraserve.gateway.tokenizing import Tokenizing
from loraserve.gateway.validation import (
    END_USER_METADATA,
    MAX_END_USER_CHARS,
    Limits,
    check_context,
    fairness_tenant,
)
from loraserve.tokenizer import Tokenizer
from loraserve.wire import Tokens

Asked = Callable[[], Fields]  # the edge's request as fields, read after admission (`generation_request.py`)


@dataclass(frozen=True)
class Call:
    """What a generation knows of the call that asked for it."""

    metadata: dict[str, str]  # lower-case keys: the API key, the trace context, the client and end-user ids
    deadline_unix: float | None = None  # the client's deadline; None: none
    client_request_id: str = ""  # the caller's id for the request, put on the trace before validation
    request: ClientRequest | None = None  # the client request of several generations this is one of


class GenerationCore:
    """Generations for every edge: admission, validation, tracing, metrics, failover, output."""

    def __init__(
        self,
        config: GatewayConfig,
        limits: Limits,
        tokenizer: Tokenizer,
        sink: TokenSink,
        scheduler: SchedulerClient,
        adapters: TenantAdapters,
        gate: Gate,
        tokenizing: Tokenizing | None = None,
        constraints: ConstraintSandbox | None = None,
    ):
        self.config, self.limits, self.tokenizer, self.sink = config, limits, tokenizer, sink
        self.tokenizing = tokenizing or Tokenizing(tokenizer, limits.max_context)  # never on the event loop
        self.constraints = constraints or ConstraintSandbox(  # structured output, compiled in child processes
            TokenizerSpec(tokenizer.to_json(), limits.vocab_size, tokenizer.eos_token_ids)
        )
        self.scheduler, self.adapters, self.gate = scheduler, adapters, gate
        self.streams = Streams(config.failover)  # live generations; the cluster watch reports to it
        self.slots = TenantSlots()  # per-tenant generation slots (token quotas: the scheduler's)
        self.ready_workers = 0  # kept current by the cluster watch (main.py)

    def authenticate(self, metadata: dict[str, str]) -> Principal:
        """The caller of a call with `metadata`; UNAVAILABLE for everyone while draining."""
        return self.gate.authenticate(metadata)

    async def generate(self, call: Call, asked: Asked) -> AsyncIterator[Event]:
        """The events of one generation: `Chunk`s, then a `Summary`. Close it to stop early (which
        cancels the request downstream); a failure is raised."""
        arrival = time.time()
        metrics.IN_FLIGHT.inc()
        code, tenant, admitted, span, stream_span, stream = "OK", metrics.UNAUTHENTICATED, None, None, None, None
        finished, reason = False, "the gateway stopped reading"
        try:
            principal = self.authenticate(call.metadata)
            tenant = principal.tenant
            principal.require(Scope.GENERATE, "generate")
            self.slots.admit(principal.tenant, principal.limits)
            admitted = principal
            request_id = uuid.uuid4().hex
            span = self._span(call, principal, request_id)
            with trace.use_span(span, end_on_exit=False):  # current only around the calls that trace
                valid, prompt_ids, version = await self._prepare(asked, principal)
            span.set_attribute("loraserve.adapter", valid.adapter or "")
            stream = FailoverStream(
                request_id,
                self.sink,
                telemetry.within(span, await self._submission(call, principal, valid, prompt_ids, version, arrival)),
                self.scheduler.cancel,
                self.config.failover,
            )
            self.streams.add(stream)
            output = Output(self.tokenizer, valid, prompt_ids, arrival)
            held: list[Chunk] = []  # chunks not sent yet: more messages already wait behind them
            try:
                async for message in stream.messages():
                    step = output.push(message)
                    if step.first_token:
                        metrics.TIME_TO_FIRST_TOKEN.observe(output.first_token_at - output.arrival)
                        stream_span = telemetry.tracer().start_span("gateway.stream", trace.set_span_in_context(span))
                    if step.chunk is not None:
                        held.append(step.chunk)
                    if step.done:
                        finished = True
                        if stream_span is not None:
                            stream_span.end()
                            stream_span = None
                        if step.still_running:
                            self.scheduler.cancel(stream.attempt_id, "stop sequence")
                        if held:
                            yield Chunk.joined(held)
                        yield self._summary(output, step, message, version, stream)
                        return
                    if held and not stream.backlog:  # a reader that is behind gets what waits as one chunk
                        yield Chunk.joined(held)
                        held = []
            except LoraserveError:
                if held:  # what came before the failure still reaches the client
                    yield Chunk.joined(held)
                raise
        except BaseException as e:
            code = metrics.outcome(e)
            if isinstance(e, asyncio.CancelledError):
                reason = "client cancelled or deadline exceeded"
            if call.request is not None:  # its sibling generations stop waiting for its cost
                call.request.abandon(e)
            raise
        finally:
            if stream is not None:
                self.streams.remove(stream)
                span.set_attribute("loraserve.failovers", stream.failovers)
                if not finished:  # once, whichever way the stream ended early
                    self.scheduler.cancel(stream.attempt_id, reason)
            for opened in (stream_span, span):
                if opened is not None:
                    opened.end()
            if admitted is not None:
                self.slots.release(admitted.tenant)
            metrics.IN_FLIGHT.dec()
            metrics.REQUESTS.labels(code, tenant).inc()

    def _span(self, call: Call, principal: Principal, request_id: str) -> trace.Span:
        """The generation's span, a child of the caller's trace context."""
        metadata = call.metadata
        span = telemetry.tracer().start_span(
            "gateway.generate", context=telemetry.context_from(metadata), kind=trace.SpanKind.SERVER
        )
        span.set_attribute("loraserve.request_id", request_id)
        span.set_attribute("loraserve.tenant", principal.tenant)
        if call.client_request_id:
            span.set_attribute("loraserve.client_request_id", call.client_request_id[:MAX_CLIENT_ID])
        if metadata.get(END_USER_METADATA):
            span.set_attribute("loraserve.end_user", metadata[END_USER_METADATA][:MAX_END_USER_CHARS])
        return span

    async def _submission(
        self,
        call: Call,
        principal: Principal,
        valid: GenerationRequest,
        prompt_ids: list[int],
        version: AdapterVersion,
        arrival: float,
    ) -> Submit:
        """How each attempt of the generation is submitted to the scheduler."""
        request, request_cost = call.request, 0
        if request is not None:  # charged once for all its generations: their costs summed
            request_cost = await request.cost_of_all(len(prompt_ids) + valid.sampling.max_new_tokens)
        return partial(
            self.scheduler.submit,
            valid=valid,
            prompt_ids=prompt_ids,
            version=version,
            arrival_unix=arrival,
            deadline_unix=call.deadline_unix,
            tenant=fairness_tenant(principal.tenant, self.gate.open, call.metadata),
            tokens_per_minute=principal.limits.tokens_per_minute or 0,  # metered by the scheduler
            request_key=request.key if request is not None else "",
            request_cost=request_cost,
        )

    def _summary(
        self, output: Output, step: Step, message: Tokens, version: AdapterVersion, stream: FailoverStream
    ) -> Summary:
        """The generation's last event, its metrics counted."""
        metrics.REQUEST_DURATION.observe(time.time() - output.arrival)
        metrics.PROMPT_TOKENS.inc(len(output.prompt_ids))
        metrics.OUTPUT_TOKENS.inc(output.completion_tokens)
        return output.summary(
            stream.request_id, step.finish_reason, message.timings, version, stream.worker_id, stream.failovers
        )

    async def _prepare(self, asked: Asked, principal: Principal) -> tuple[GenerationRequest, list[int], AdapterVersion]:
        tracer = telemetry.tracer()
        ns = Namespace.of(principal)
        with tracer.start_as_current_span("gateway.validate"):
            valid = parse(asked(), self.limits, lambda name: ns.check(name, "adapter"))
            if valid.prompt_text is not None:  # a text too long for the context is refused before any lookup
                self.tokenizing.check_fits(valid.prompt_text, "prompt.text")
        if valid.constraint is not None:  # compiled and checked in the sandbox, never in this process
            with tracer.start_as_current_span("gateway.constraint"):
                valid = valid.with_grammar(await self.constraints.compile(valid.constraint))
        version = AdapterVersion()
        if valid.adapter is not None:  # resolved first: a worker starts fetching it while the prompt is tokenized
            with tracer.start_as_current_span("gateway.adapter_lookup"):
                store_name, version = await self.adapters.resolve(ns, valid.adapter)
            valid = msgspec.structs.replace(valid, adapter=store_name)  # what workers fetch: TENANT~NAME or public
            self.scheduler.hint(store_name, version, principal.tenant)
            await asyncio.sleep(0)  # the hint's call starts before the prompt is tokenized
        with tracer.start_as_current_span("gateway.tokenize"):
            if valid.prompt_text is None:
                prompt_ids = valid.prompt_ids
            else:  # in a tokenizer thread: the event loop serves every other call meanwhile
                prompt_ids = await self.tokenizing.encode(valid.prompt_text, "prompt.text")
            check_context(prompt_ids, valid.sampling, self.limits)
        return valid, prompt_ids, version
