"""The public gRPC API (`loraserve.v1.LoraServe`): validate, tokenize, submit, stream back.

A generation: authenticate → validate (INVALID_ARGUMENT naming the field) → tokenize → resolve the
adapter's current version (the store-fed cache, else the store: NOT_FOUND) → Submit to the
scheduler (RESOURCE_EXHAUSTED, UNAVAILABLE) → read tokens from the sink, detokenize incrementally, apply stop sequences,
stream to the client → a summary with the finish reason, usage and latency breakdown. If the
client cancels or its deadline passes, the request is cancelled downstream at once. A worker lost
mid-stream is replaced without the client noticing (`gateway/failover.py`).

Draining (SIGTERM): `drain()` makes every new call UNAVAILABLE at once while the streams in flight
go on; the process waits for them (up to its drain timeout) before it stops.

The OpenAI-compatible HTTP edge (`gateway/http/`) runs its generations through this same path
(`generate_events`, `authenticate`): it only translates requests in and events out.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from typing import Protocol

import grpc
from opentelemetry import trace

from loraserve import telemetry
from loraserve.convert import FINISH_REASONS, logprobs_to_pb, prompt_logprobs_to_pb, sampling_to_pb
from loraserve.errors import InvalidRequestError, LoraserveError, UnavailableError
from loraserve.gateway import metrics
from loraserve.gateway.adapter_versions import AdapterVersion, AdapterVersions
from loraserve.gateway.audit import AuditRecord, audited
from loraserve.gateway.auth import Authenticator, Principal
from loraserve.gateway.failover import FailoverConfig, FailoverStream, Streams
from loraserve.gateway.namespaces import Namespace
from loraserve.gateway.quotas import QuotaExceededError, Quotas
from loraserve.gateway.stops import StopFilter
from loraserve.gateway.tenant_adapters import TenantAdapters, renamed_uploads, shown
from loraserve.gateway.tenants import Scope
from loraserve.gateway.token_sink import TokenSink
from loraserve.gateway.validation import (
    END_USER_METADATA,
    MAX_END_USER_CHARS,
    Limits,
    ValidRequest,
    check_context,
    fairness_tenant,
    validate_generate,
)
from loraserve.grpc_utils import RETRY_AFTER_KEY, forward_stream, internal_call, refuse_stream
from loraserve.names import TENANT_NAME
from loraserve.tokenizer import IncrementalDetokenizer, Tokenizer
from loraserve.v1 import adapter_store_pb2_grpc, common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2
from loraserve.v1 import scheduler_pb2_grpc as sched_grpc
from loraserve.v1.adapter_store_pb2 import GetStoreStateRequest

log = logging.getLogger(__name__)
# statuses of a store call that may say its connection broke rather than give the store's answer
_MAYBE_TRANSPORT = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)


class CallContext(Protocol):
    """What a generation needs from its call: `grpc.aio.ServicerContext` has it, and the HTTP edge's
    `HttpCall` presents its request headers the same way."""

    def invocation_metadata(self) -> Sequence[tuple[str, str]] | None: ...

    def time_remaining(self) -> float | None: ...

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None: ...


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str
    model_type: str
    max_lora_rank: int
    internal_timeout_s: float = 5.0  # calls to the scheduler and the store
    upload_timeout_s: float = 120.0  # an upload's relay to the store (or the client's deadline, if sooner)
    failover: FailoverConfig = field(default_factory=FailoverConfig)


class LoraServeService(gateway_pb2_grpc.LoraServeServicer):
    """The public API (`loraserve.v1.LoraServe`): authenticates, validates, streams generations
    (each a `FailoverStream`), and relays adapter admin to the store."""

    def __init__(
        self,
        config: GatewayConfig,
        limits: Limits,
        tokenizer: Tokenizer,
        sink: TokenSink,
        scheduler: sched_grpc.SchedulerStub,
        store: adapter_store_pb2_grpc.AdapterStoreStub,
        auth: Authenticator,
    ):
        self.config, self.limits, self.tokenizer, self.sink = config, limits, tokenizer, sink
        self.scheduler, self.store, self.auth = scheduler, store, auth
        self.ready_workers = 0  # kept current by the health poller in main.py
        self.streams = Streams(config.failover)  # live generations; the cluster watch reports to it
        self.adapter_versions = AdapterVersions()  # kept by the store's Watch (main.py)
        self.adapters = TenantAdapters(self._store, self.adapter_versions)  # names as each tenant sees them
        self.quotas = Quotas()  # per-tenant generation slots (token quotas: the scheduler's)
        self.draining = False
        self._background: set[asyncio.Task] = set()

    def drain(self) -> None:
        """From now on refuse every call with UNAVAILABLE; generations in flight go on."""
        self.draining = True

    # ---- generation ----------------------------------------------------------------------------
    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        text, tokens, logprobs, prompt_logprobs, summary = [], [], [], [], None
        async for event in self._generate(request, context):
            if event.HasField("chunk"):
                text.append(event.chunk.text)
                tokens += event.chunk.token_ids
                logprobs += event.chunk.logprobs
                prompt_logprobs += event.chunk.prompt_logprobs
            else:
                summary = event.summary
        summary.text = "".join(text)
        summary.token_ids.extend(tokens)
        summary.logprobs.extend(logprobs)
        summary.prompt_logprobs.extend(prompt_logprobs)
        return summary

    async def GenerateStream(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        async for event in self._generate(request, context):
            yield event

    def generate_events(
        self, request: gateway_pb2.GenerateRequest, call: CallContext
    ) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        """One generation for an edge other than gRPC (`gateway/http/`): the same authentication, quotas,
        validation, tracing, metrics, failover and downstream cancel as `GenerateStream`."""
        return self._generate(request, call)

    def authenticate(self, metadata: dict[str, str]) -> Principal:
        """The caller of a call with `metadata` (lower-case keys); UNAVAILABLE for everyone while draining."""
        if self.draining:
            raise UnavailableError("this gateway is shutting down; retry on another one")
        return self.auth.authenticate(metadata)

    async def _generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        arrival = time.time()
        metrics.IN_FLIGHT.inc()
        code, events, tenant, admitted = "OK", None, metrics.UNAUTHENTICATED, None
        try:
            principal = self._principal(context)
            tenant = principal.tenant
            principal.require(Scope.GENERATE, "generate")
            self._admit(principal, context)
            admitted = principal
            metadata = _metadata(context)
            events = self._generate_traced(request, principal, metadata, context, arrival)
            async for event in events:
                yield event
        except BaseException as e:
            code = metrics.outcome(e)
            raise
        finally:
            if events is not None:
                await events.aclose()  # its clean-up (cancel downstream) now, not at garbage collection
            if admitted is not None:
                self.quotas.release(admitted.tenant)
            metrics.IN_FLIGHT.dec()
            metrics.REQUESTS.labels(code, tenant).inc()

    def _admit(self, principal: Principal, context) -> None:
        """Take one of the tenant's generation slots; RESOURCE_EXHAUSTED with a retry hint if over quota."""
        try:
            self.quotas.admit(principal.tenant, principal.limits)
        except QuotaExceededError as e:
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(math.ceil(e.retry_after_s * 1000))),))
            raise

    async def _generate_traced(
        self, request: gateway_pb2.GenerateRequest, principal: Principal, metadata: dict[str, str], context, arrival
    ) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        request_id = uuid.uuid4().hex
        parent = telemetry.context_from(metadata)
        span = telemetry.tracer().start_span("gateway.generate", context=parent, kind=trace.SpanKind.SERVER)
        try:  # the span is made current step by step (`current_while_producing`), never across a yield
            span.set_attribute("loraserve.request_id", request_id)
            span.set_attribute("loraserve.tenant", principal.tenant)
            if request.client_request_id:
                span.set_attribute("loraserve.client_request_id", request.client_request_id[:128])
            if metadata.get(END_USER_METADATA):
                span.set_attribute("loraserve.end_user", metadata[END_USER_METADATA][:MAX_END_USER_CHARS])
            with trace.use_span(span, end_on_exit=False):
                valid, prompt_ids, version = await self._prepare(request, principal)
            span.set_attribute("loraserve.adapter", valid.adapter or "")

            tenant = fairness_tenant(principal.tenant, self.auth.open, metadata)
            quota = principal.limits.tokens_per_minute or 0  # metered by the scheduler, for every gateway

            async def submit(attempt_id: str, attempt: int, output_ids: list[int]) -> str:
                return await self._submit(
                    attempt_id, attempt, valid, prompt_ids, version, context, arrival, output_ids, tenant, quota
                )

            stream = FailoverStream(request_id, self.sink, submit, self._cancel_downstream, self.config.failover)
            self.streams.add(stream)
            finished = False
            events = self._stream(request_id, valid, prompt_ids, stream, arrival, version)
            try:
                async for event in telemetry.current_while_producing(span, events):
                    if event.HasField("summary"):
                        finished = True
                    yield event
            except asyncio.CancelledError:
                self._cancel_downstream(stream.attempt_id, "client cancelled or deadline exceeded")
                raise
            finally:
                self.streams.remove(stream)
                span.set_attribute("loraserve.failovers", stream.failovers)
                if not finished:
                    self._cancel_downstream(stream.attempt_id, "the gateway stopped reading")
        finally:
            span.end()

    async def _prepare(self, request, principal: Principal) -> tuple[ValidRequest, list[int], AdapterVersion]:
        tracer = telemetry.tracer()
        ns = Namespace.of(principal)
        with tracer.start_as_current_span("gateway.validate"):
            valid = validate_generate(request, self.limits, lambda name: ns.check(name, "adapter"))
        version = AdapterVersion()
        if valid.adapter is not None:  # resolved first: a worker starts fetching it while the prompt is tokenized
            with tracer.start_as_current_span("gateway.adapter_lookup"):
                store_name, version = await self.adapters.resolve(ns, valid.adapter)
            valid = replace(valid, adapter=store_name)  # what workers fetch: TENANT~NAME or a public name
            self._hint(store_name, version, principal.tenant)
            await asyncio.sleep(0)  # the hint's call starts before the prompt is tokenized
        with tracer.start_as_current_span("gateway.tokenize"):
            prompt_ids = valid.prompt_ids if valid.prompt_ids is not None else self.tokenizer.encode(valid.prompt_text)
            check_context(prompt_ids, valid.sampling, self.limits)
        return valid, prompt_ids, version

    def _hint(self, adapter: str, version: AdapterVersion, tenant: str) -> None:
        """Tell the scheduler, without waiting, that a request for this adapter version follows: the worker it
        would go to starts fetching the adapter now (`scheduler/hints.py`). A hint that fails changes nothing."""
        hint = scheduler_pb2.PrepareAdapterRequest(
            adapter=adapter,
            adapter_version=version.version,
            adapter_sha256=version.sha256,
            adapter_rank=version.rank,
            tenant=tenant if TENANT_NAME.fullmatch(tenant) else "",
        )

        metadata = telemetry.grpc_metadata()  # the request's trace: the worker's fetch and the store join it

        async def send() -> None:
            try:
                await self.scheduler.PrepareAdapter(hint, timeout=self.config.internal_timeout_s, metadata=metadata)
            except Exception as e:  # a best-effort hint: an older scheduler (UNIMPLEMENTED), one going away
                log.debug("adapter hint for %s not taken: %s", adapter, e)

        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _submit(
        self,
        request_id: str,
        attempt: int,
        valid: ValidRequest,
        prompt_ids: list[int],
        version: AdapterVersion,
        context,
        arrival: float,
        output_ids: list[int],
        tenant: str = "",
        tokens_per_minute: int = 0,
    ) -> str:
        """Queue one attempt with the scheduler; returns the instance of the scheduler that took it.
        Its quota refusal's retry hint goes on to the client (trailing metadata `retry-after-ms`)."""
        remaining = context.time_remaining()
        submit = scheduler_pb2.SubmitRequest(
            request_id=request_id,
            prompt_ids=prompt_ids,
            adapter=valid.adapter or "",
            adapter_version=version.version,
            adapter_sha256=version.sha256,
            adapter_rank=version.rank,
            sampling=sampling_to_pb(valid.sampling),
            max_new_tokens=valid.sampling.max_new_tokens,
            stop_token_ids=list(valid.sampling.stop_token_ids),
            deadline_unix=time.time() + remaining if remaining is not None else 0.0,
            reply_to=self.sink.address,
            arrival_unix=arrival,
            output_ids=output_ids,
            attempt=attempt,
            tenant=tenant,
            prefill_group=f"{tenant}/{valid.prefill_group}" if valid.prefill_group else "",
            cache_salt=f"{len(tenant)}:{tenant}/{valid.cache_salt}",
            ttft_slo_s=valid.ttft_slo_s,
            tokens_per_minute=tokens_per_minute,
        )

        async def call() -> scheduler_pb2.SubmitResponse:
            try:
                return await self.scheduler.Submit(
                    submit, timeout=self.config.internal_timeout_s, metadata=telemetry.grpc_metadata()
                )
            except grpc.aio.AioRpcError as e:
                hint = [(k, v) for k, v in e.trailing_metadata() or () if k == RETRY_AFTER_KEY]
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and hint:
                    context.set_trailing_metadata(hint[:1])
                raise

        with telemetry.tracer().start_as_current_span("gateway.submit"):
            response = await internal_call("the scheduler", call)
        return response.instance

    async def _stream(self, request_id, valid: ValidRequest, prompt_ids, stream: FailoverStream, arrival, version):
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=not valid.keep_special_tokens)
        stops = StopFilter(list(valid.stop), include=valid.include_stop)
        special = set() if valid.keep_special_tokens else set(self.tokenizer.eos_token_ids)
        completion_tokens, first_token_at, stream_span, cached_tokens = 0, None, None, 0
        async for message in stream.messages():
            cached_tokens = max(cached_tokens, message.cached_tokens)
            chunk = gateway_pb2.TokenChunk(
                token_ids=message.token_ids, logprobs=logprobs_to_pb(message.token_ids, message.logprobs)
            )
            if message.token_ids and first_token_at is None:
                if valid.sampling.prompt_logprobs is not None:  # they come with the first token
                    chunk.prompt_logprobs.extend(prompt_logprobs_to_pb(prompt_ids, message.prompt_logprobs))
                first_token_at = time.time()
                metrics.TIME_TO_FIRST_TOKEN.observe(first_token_at - arrival)
                stream_span = telemetry.tracer().start_span("gateway.stream")
            completion_tokens += len(message.token_ids)
            text = "".join(detok.push(t) for t in message.token_ids if t not in special)
            if message.finished:
                text += detok.flush()
            shown, stopped = stops.feed(text)
            if message.finished and not stopped:
                shown += stops.flush()
            if shown or message.token_ids:
                chunk.text = shown
                yield gateway_pb2.GenerateStreamResponse(chunk=chunk)
            if stopped or message.finished:
                reason = "stop_sequence" if stopped else message.finish_reason
                if stopped and not message.finished:
                    self._cancel_downstream(stream.attempt_id, "stop sequence")
                if stream_span is not None:
                    stream_span.end()
                metrics.REQUEST_DURATION.observe(time.time() - arrival)
                metrics.PROMPT_TOKENS.inc(len(prompt_ids))
                metrics.OUTPUT_TOKENS.inc(completion_tokens)
                summary = self._summary(
                    request_id,
                    valid,
                    prompt_ids,
                    completion_tokens,
                    reason,
                    message.timings,
                    arrival,
                    first_token_at,
                    version,
                    stream,
                    cached_tokens,
                )
                yield gateway_pb2.GenerateStreamResponse(summary=summary)
                return

    def _summary(
        self,
        request_id,
        valid,
        prompt_ids,
        completion_tokens,
        reason,
        timings,
        arrival,
        first_token_at,
        version,
        stream: FailoverStream,
        cached_tokens: int = 0,
    ):
        now = time.time()
        return gateway_pb2.GenerateResponse(
            request_id=request_id,
            client_request_id=valid.client_request_id,
            finish_reason=FINISH_REASONS.get(reason or "", common_pb2.FINISH_REASON_UNSPECIFIED),
            usage=common_pb2.Usage(
                prompt_tokens=len(prompt_ids), completion_tokens=completion_tokens, cached_tokens=cached_tokens
            ),
            timings=common_pb2.Timings(
                queue_s=timings.get("queue_s", 0.0),
                adapter_load_s=timings.get("adapter_load_s", 0.0),
                prefill_s=timings.get("prefill_s", 0.0),
                time_to_first_token_s=(first_token_at - arrival) if first_token_at else 0.0,
                decode_s=timings.get("decode_s", 0.0),
                total_s=now - arrival,
            ),
            adapter_version=version.version,
            worker_id=stream.worker_id,
            failovers=stream.failovers,
        )

    def _cancel_downstream(self, request_id: str, reason: str) -> None:
        async def cancel() -> None:
            try:
                await self.scheduler.Cancel(
                    scheduler_pb2.CancelRequest(request_id=request_id, reason=reason),
                    timeout=self.config.internal_timeout_s,
                )
            except grpc.aio.AioRpcError as e:
                log.warning("could not cancel %s downstream: %s", request_id, e.details())

        task = asyncio.get_running_loop().create_task(cancel())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- tokenizer and model -------------------------------------------------------------------
    async def Tokenize(self, request: gateway_pb2.TokenizeRequest, context):
        self._principal(context).require(Scope.GENERATE, "tokenize")
        if len(request.text.encode()) > self.limits.max_prompt_bytes:
            raise InvalidRequestError("text", f"is longer than {self.limits.max_prompt_bytes} bytes")
        ids = self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        return gateway_pb2.TokenizeResponse(ids=ids, tokens=self.tokenizer.token_strings(ids))

    async def Detokenize(self, request: gateway_pb2.DetokenizeRequest, context):
        self._principal(context).require(Scope.GENERATE, "detokenize")
        vocab = self.limits.vocab_size
        bad = next((i for i, t in enumerate(request.ids) if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                "ids", f"ids[{bad}] = {request.ids[bad]} is not below the vocabulary size {vocab}"
            )
        text = self.tokenizer.decode(list(request.ids), skip_special_tokens=request.skip_special_tokens)
        return gateway_pb2.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request, context):
        self._principal(context).require(Scope.GENERATE, "read model info")
        return gateway_pb2.ModelInfo(
            model_type=self.config.model_type,
            model_name=self.config.model_name,
            vocab_size=self.limits.vocab_size,
            max_context_length=self.limits.max_context,
            default_max_new_tokens=self.limits.default_max_new_tokens,
            max_lora_rank=self.config.max_lora_rank,
            ready_workers=self.ready_workers,
            eos_token_ids=list(self.tokenizer.eos_token_ids),
            server_version=package_version(),
        )

    # ---- adapter admin (proxied to the adapter store, in the caller's namespace) ----------------
    async def ListAdapters(self, request, context):
        principal = self._principal(context)
        principal.require(Scope.GENERATE, "list adapters")
        return await self.adapters.list(Namespace.of(principal))

    async def DescribeAdapter(self, request, context):
        principal = self._principal(context)
        principal.require(Scope.GENERATE, "describe adapters")
        ns = Namespace.of(principal)
        return await self.adapters.describe(ns, ns.check(request.name))

    async def UploadAdapter(self, request_iterator, context):
        with audited("upload") as record:
            try:
                ns = self._adapter_admin(context, record, "upload adapters")
            except LoraserveError:
                await refuse_stream(request_iterator, context)  # the client may still be sending
                raise
            remaining = context.time_remaining()
            timeout = min(self.config.upload_timeout_s, remaining if remaining is not None else math.inf)
            targets: list[str] = []
            renamed = renamed_uploads(ns, request_iterator, targets)
            try:
                info = await internal_call("the adapter store", lambda: self._relay_upload(renamed, timeout))
            except LoraserveError:
                record.adapter = targets[0] if targets else "-"
                await refuse_stream(request_iterator, context)
                raise
            record.adapter, record.version = info.name, info.version
            self.adapter_versions.learned(info)
            return shown(ns, info)

    async def _relay_upload(self, requests: AsyncIterator[gateway_pb2.UploadAdapterRequest], timeout: float):
        """The store's Upload fed with `requests`. A transport failure of that call (the store died or
        its connection broke mid-upload) ends UNAVAILABLE, saying the upload may be retried: any
        UNAVAILABLE, and any INTERNAL, UNKNOWN or CANCELLED while the store does not answer (grpc.aio
        reports a write to a connection that just broke as INTERNAL, hiding why)."""
        try:
            return await forward_stream(self.store.Upload, requests, timeout, telemetry.grpc_metadata())
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                why = e.details() or "unreachable"
            elif e.code() in _MAYBE_TRANSPORT and not await self._store_answers():
                why = "its connection broke during the upload"
            else:
                raise
            log.warning("upload relay: the adapter store went away (%s: %s)", e.code().name, e.details())
            raise UnavailableError(
                f"the adapter store is unavailable ({why}): the upload did not complete and may be retried"
            ) from None

    async def _store_answers(self) -> bool:
        """Does the adapter store answer a call at all (any status but UNAVAILABLE or a timeout)?"""
        try:
            await self.store.GetStoreState(GetStoreStateRequest(), timeout=1.0, metadata=telemetry.grpc_metadata())
        except grpc.aio.AioRpcError as e:
            return e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        return True

    async def RegisterAdapterFromPath(self, request, context):
        with audited("register") as record:
            ns = self._adapter_admin(context, record, "register adapters", request.name)
            target = gateway_pb2.RegisterAdapterFromPathRequest()
            target.CopyFrom(request)
            target.name = record.adapter = ns.target(ns.check(request.name))
            info = await self._store("RegisterFromPath", target)
            record.version = info.version
            self.adapter_versions.learned(info)
            return shown(ns, info)

    async def DeleteAdapter(self, request, context):
        with audited("delete") as record:
            ns = self._adapter_admin(context, record, "delete adapters", request.name)
            record.adapter = ns.target(ns.check(request.name))
            deleted = await self.adapters.delete(ns, request.name)
            record.version = deleted.version
            self.adapter_versions.forget(record.adapter)
            return deleted

    def _principal(self, context) -> Principal:
        """The caller, authenticated; UNAVAILABLE for everyone while draining."""
        return self.authenticate(_metadata(context))

    def _adapter_admin(self, context, record: AuditRecord, action: str, name: str = "") -> Namespace:
        """The caller's namespace, if it holds the `adapters` scope; who asked, for what, goes in the audit record."""
        principal = self._principal(context)
        ns = Namespace.of(principal)
        record.tenant = principal.tenant
        if ns.valid(name):
            record.adapter = ns.target(name)
        principal.require(Scope.ADAPTERS, action)
        return ns

    async def _store(self, method: str, request):
        call = getattr(self.store, method)
        return await internal_call(
            "the adapter store",
            lambda: call(request, timeout=self.config.internal_timeout_s, metadata=telemetry.grpc_metadata()),
        )


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def package_version() -> str:
    """The installed loraserve release; "unknown" when run from a source tree never installed."""
    try:
        return version("loraserve")
    except PackageNotFoundError:
        return "unknown"
