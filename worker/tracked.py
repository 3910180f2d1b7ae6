"""What the worker's core (`core.py`) keeps per request besides the engine's `Request`, and what it reports of it
when the request ends: its timings (the gateway's latency breakdown) and its trace spans.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from loraserve import telemetry
from loraserve.request_spec import RequestSpec
from loraserve.worker.request import Request


@dataclass
class Tracked:
    """One request on this worker: delivery, timings, trace."""

    spec: RequestSpec  # as the ASSIGN carried it (the engine's Request holds the same one)
    queued_s: float  # time it spent in the scheduler's queue
    received: float  # time.time() at the worker
    context: object  # trace context from the scheduler
    request: Request | None = None  # None while its matcher is built or its adapter fetched
    trace: dict[str, str] = field(default_factory=dict)  # the ASSIGN's trace carrier (an adapter fetch joins it)
    guide: Any = None  # with a grammar: its llguidance matcher, built off the step loop (`guide_builds.py`)
    adapter_source: str = "none"  # none | hit | prefetched | cold
    adapter_transport: str = ""  # a cold one's: shared-memory | rows | files (`worker/fetch_threads.py`)
    fetch_s: float = 0.0
    expired: bool = False

    def timings(self, wall: float, mono: float) -> dict[str, float]:
        """Where its time went, in seconds (and the first token's and first step's wall-clock time), at the
        time `wall` (time.time()) = `mono` (time.monotonic())."""
        r = self.request
        to_wall = wall - mono
        timings = {"queue_s": self.queued_s, "adapter_load_s": self.fetch_s}
        if r is not None and r.first_scheduled is not None:
            timings["queue_s"] += r.first_scheduled + to_wall - self.received
            timings["adapter_load_s"] += r.adapter_wait_s
            if r.first_token is not None:
                timings["prefill_s"] = r.first_token - r.first_scheduled
                timings["decode_s"] = (r.finished_at or mono) - r.first_token
                timings["first_token_unix"] = r.first_token + to_wall
                timings["first_scheduled_unix"] = r.first_scheduled + to_wall
        return timings

    def record_spans(self, worker_id: str, timings: dict[str, float], error_status: str | None) -> None:
        """The worker's spans of the request's trace: the request, its adapter fetch, prefill and decode."""
        tracer = telemetry.tracer()
        received_ns = int(self.received * 1e9)
        root = tracer.start_span("worker.request", context=self.context, start_time=received_ns)
        root.set_attribute("loraserve.request_id", self.spec.request_id)
        root.set_attribute("loraserve.worker_id", worker_id)
        if error_status:
            root.set_attribute("loraserve.error_status", error_status)
        ctx = trace.set_span_in_context(root)
        if self.spec.adapter:
            span = tracer.start_span("worker.adapter_fetch", context=ctx, start_time=received_ns)
            span.set_attribute("loraserve.adapter", f"{self.spec.adapter}@{self.spec.adapter_version}")
            span.set_attribute("loraserve.adapter.source", self.adapter_source)
            if self.adapter_transport:
                span.set_attribute("loraserve.adapter.transport", self.adapter_transport)
            span.end(end_time=received_ns + int(timings.get("adapter_load_s", 0.0) * 1e9))
        if "first_token_unix" in timings:
            start = int(timings["first_scheduled_unix"] * 1e9)
            first = int(timings["first_token_unix"] * 1e9)
            prefill = tracer.start_span("worker.prefill", context=ctx, start_time=start)
            request = self.request
            if request is not None:  # what the prefill did not compute: found cached, or copied from its group
                prefill.set_attribute("loraserve.prompt_tokens", len(request.spec.prompt_ids))
                prefill.set_attribute("loraserve.cached_tokens", request.cached_tokens)
                prefill.set_attribute("loraserve.shared_prefill_tokens", request.shared_prefill_tokens)
            prefill.end(end_time=first)
            tracer.start_span("worker.decode", context=ctx, start_time=first).end(end_time=time.time_ns())
        root.end()
