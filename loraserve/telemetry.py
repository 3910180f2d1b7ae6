"""OpenTelemetry set-up for every role, and trace-context carriers for gRPC metadata and ZMQ.

One trace per request: the gateway starts it; the context travels in gRPC metadata
(`traceparent`) to the scheduler and in a `trace` map inside ZMQ messages to workers and the
adapter store, so spans from all four roles join the same trace.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from loraserve.config_cli import setting

log = logging.getLogger(__name__)
T = TypeVar("T")

EXPORTERS = ("none", "console", "otlp")
_provider: TracerProvider | None = None


@dataclass(frozen=True)
class TracingSettings:
    """Where a role's spans go (the "tracing" flags of every role)."""

    trace_exporter: str = setting("none", "where spans go", choices=EXPORTERS)
    otlp_endpoint: str = setting("http://127.0.0.1:4317", "OTLP/gRPC collector (with --trace-exporter otlp)")


def setup_tracing(service: str, exporter: str, otlp_endpoint: str | None = None) -> None:
    """Install the tracer provider of this process (once). `exporter`: none, console or otlp."""
    global _provider  # noqa: PLW0603 - the SDK's provider is process-global by design; we only remember ours to flush it
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown trace exporter {exporter!r}; choose {', '.join(EXPORTERS)}")
    provider = TracerProvider(resource=Resource.create({"service.name": f"loraserve-{service}"}))
    if exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True)))
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing: %s%s", exporter, f" -> {otlp_endpoint}" if exporter == "otlp" else "")


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.shutdown()


@functools.cache
def tracer() -> trace.Tracer:
    """The process's tracer, made once: `get_tracer` costs tens of µs per call. Made before
    `setup_tracing`, it is a proxy that follows the provider set later."""
    return trace.get_tracer("loraserve")


def carrier() -> dict[str, str]:
    """The current trace context as a string map (for a ZMQ message's `trace` field)."""
    out: dict[str, str] = {}
    inject(out)
    return out


def grpc_metadata() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata pairs."""
    return list(carrier().items())


def context_from(source: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> otel_context.Context:
    """A context from a carrier map or gRPC invocation metadata."""
    if source is None:
        return otel_context.get_current()
    if not isinstance(source, Mapping):
        source = {k: v for k, v in source if isinstance(v, str)}
    return extract(dict(source))


def within(span: trace.Span, call: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """`call`, with `span` current while it runs: attached and detached inside one call, in the caller's task.

    A generation's span is made current only around the calls that trace (its submissions), never per
    token and never across a generator's `yield`: a client that cancels a stream closes the generator in
    another context, where a span attached across the `yield` could not be detached."""

    async def traced(*args, **kwargs) -> T:
        with trace.use_span(span, end_on_exit=False):
            return await call(*args, **kwargs)

    return traced
