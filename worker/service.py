"""The worker process: the engine's step loop, fed by the scheduler, streaming to gateways.

One thread runs everything that touches the engine: between steps it takes the scheduler's
messages (ASSIGN / CANCEL / PREFETCH, already received and decoded by the I/O thread,
`worker/io_thread.py`), registers adapters that background fetch threads brought
from the adapter store, aborts requests whose deadline passed, runs a step, streams the new
tokens to each request's gateway and reports its state to the scheduler (the I/O thread encodes
and sends both: the step loop never touches a socket). Fetching (network,
validation, packing into the pool's row layout) never happens on the step loop; prefetched adapters
are copied into the pool in the background by the engine. A PREFETCH carries the scheduler's
predicted likelihood of each adapter (`scores`): the engine remembers them and a prefetch never
evicts an adapter more likely to be used than the one it fetches.

Scheduler messages are checked by `wire.decode` (types, lengths, ranges, the reply_to endpoint, the
sampling values) before they touch anything; a bad one is logged (rate-limited) and dropped. An
ASSIGN carries the request's `RequestSpec`, which the engine's `Request` holds unchanged. A gateway
address that cannot be connected to loses that request's tokens, never the worker.

A generation whose gateway is gone stops (`GatewayWatch`, on the I/O thread): each gateway's PUSH socket is watched
by a ZMQ socket monitor, and when its connection drops (the gateway died, was restarted, or the
network broke: a PUSH socket never fails a send for that, it queues) every request streaming to it
is aborted and handed back with UNAVAILABLE and `retry`. A gateway that is still alive receives that
once it reconnects and fails the request over with the tokens it did receive; a dead one's
generations no longer run on to `max_new_tokens`.

Every ASSIGN is acknowledged to its gateway at once (an empty TOKENS message naming this worker),
so the gateway knows the request left the scheduler. An ASSIGN may continue a request another
worker started (`output_ids`: failover); the engine recomputes those tokens and goes on.

Stopping (SIGTERM) drains: the worker reports `draining` (the scheduler places nothing more on it),
finishes what it holds for up to `drain_timeout_s`, hands what is left back to the gateways to
fail over (UNAVAILABLE, retry), sends a last report that drops it, and exits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq
from opentelemetry import trace

from loraserve import telemetry
from loraserve.dispatch import Dispatcher
from loraserve.errors import LoraserveError
from loraserve.internal_auth import Curve, InternalKeys
from loraserve.log_limit import RateLimitedLog
from loraserve.params import SamplingParams
from loraserve.request_spec import RequestSpec
from loraserve.wire import (
    MAX_PREFIXES,
    MAX_RESIDENT,
    MAX_STEP_SAMPLES,
    AdapterKey,
    Assign,
    Cancel,
    Prefetch,
    StepTokens,
    Tokens,
    WorkerReport,
)
from loraserve.worker import metrics
from loraserve.worker.engine import Cached, Engine, GenerateRequest, StepOutput
from loraserve.worker.fetch_threads import FetchConfig, FetchThreads, Wakeup
from loraserve.worker.io_thread import GatewayGone, Unsendable, WorkerIO
from loraserve.worker.request import FinishReason, Request

log = logging.getLogger(__name__)
PREFIXES_MIN_S = 0.05  # cached-prefix fingerprints go out at most this often when they change ...
PREFIXES_RESEND_S = 2.0  # ... and this often when they do not


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    scheduler_address: str = "tcp://127.0.0.1:7101"
    store_address: str = "tcp://127.0.0.1:7301"
    report_interval_s: float = 0.25  # heartbeat when idle
    fetch_timeout_s: float = 10.0
    fetch_threads: int = 2
    drain_timeout_s: float = 30.0  # on SIGTERM: how long requests in flight may take to finish here
    keys: InternalKeys | None = None  # CURVE keys: talk to the scheduler, store and gateways as a worker
    adapter_rows: bool = True  # fetch adapters in the pool's row layout (`worker/fetch_threads.py`)
    shm_root: Path | None = Path("/dev/shm")  # map rows from a store on this host; None: over the socket only
    verify_shared_memory: bool = False  # hash mapped rows too (`loraserve/shared_rows.py` says why it is off)

    def curve_to(self, role: str) -> Curve | None:
        return self.keys.client_of(role) if self.keys is not None else None

    def fetching(self) -> FetchConfig:
        return FetchConfig(
            self.store_address,
            self.fetch_timeout_s,
            self.fetch_threads,
            self.curve_to("store"),
            self.adapter_rows,
            self.shm_root,
            self.verify_shared_memory,
        )


@dataclass
class _Tracked:
    """What the service keeps per request besides the engine's Request: delivery, timings, trace."""

    spec: RequestSpec  # as the ASSIGN carried it (the engine's Request holds the same one)
    queued_s: float  # time it spent in the scheduler's queue
    received: float  # time.time() at the worker
    context: object  # trace context from the scheduler
    request: Request | None = None  # None while its adapter is being fetched
    adapter_source: str = "none"  # none | hit | prefetched | cold
    adapter_transport: str = ""  # a cold one's: shared-memory | rows | files (`worker/fetch_threads.py`)
    fetch_s: float = 0.0
    expired: bool = False


class WorkerService:
    """The worker process's one loop: scheduler messages in, engine steps, tokens out, reports back.

    Owns per-request delivery (gateway address, timings, trace) and the adapter fetches in flight;
    the engine owns everything about the requests themselves (see the module docstring).
    """

    def __init__(self, engine: Engine, config: WorkerConfig):
        self.engine, self.config = engine, config
        self.ctx = zmq.Context()
        self._dropped = RateLimitedLog(log)
        self.tracked: dict[str, _Tracked] = {}
        self.awaiting: dict[AdapterKey, list[str]] = {}  # adapter being fetched -> requests parked on it
        self._wakeup = Wakeup()  # the I/O and fetch threads wake the loop when a message or an adapter arrives
        self.io = WorkerIO(
            self.ctx,
            config.scheduler_address,
            config.worker_id,
            self._wakeup,
            config.curve_to("scheduler"),
            config.curve_to("gateway"),
        )
        self._fetches = FetchThreads(config.fetching(), engine, self._wakeup)
        self._poller = zmq.Poller()
        self._poller.register(self._wakeup.fd, zmq.POLLIN)
        self.finished_since_report: list[str] = []
        self.step_samples: list[tuple[int, int, int, int, float]] = []  # (StepShape..., seconds) since the last report
        self.ready = False
        self.draining = False
        self._step_seconds = metrics.STEP_SECONDS.labels(config.worker_id)
        self._last_report = 0.0
        self._prefixes_sent = (-1, 0.0)  # (pool.prefix_epoch, monotonic time) of the last report that carried them
        self.last_report: WorkerReport | None = None  # read by the metrics endpoint's thread
        self.instance = uuid.uuid4().hex  # tells the scheduler a restarted worker from the process it replaced
        self._inbox = Dispatcher({Assign: self._on_assign, Cancel: self._on_cancel, Prefetch: self._on_prefetch})
        self._io_events = Dispatcher(
            {Unsendable: self._on_unsendable, GatewayGone: lambda event: self._gateway_gone(event.address)}
        )

    # ---- main loop -----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self._report()  # register (not ready yet)
        self._warm_up()
        self.ready = True
        self._report()
        log.info("worker %s ready: %d pool pages", self.config.worker_id, self.engine.layout.num_pages)
        drain_deadline = None
        try:
            while drain_deadline is None or (self.tracked and time.monotonic() < drain_deadline):
                if stop.is_set() and drain_deadline is None:
                    drain_deadline = time.monotonic() + self.config.drain_timeout_s
                    self._start_draining()
                busy = self.engine.has_unfinished()
                self._take_messages(block_s=0.0 if busy else min(0.05, self.config.report_interval_s))
                self._register_fetched()
                self._expire_deadlines()
                if self.engine.has_unfinished():
                    started = time.perf_counter()
                    outputs = self.engine.step()
                    seconds = time.perf_counter() - started
                    self._step_seconds.observe(seconds)
                    self._sample_step(seconds)
                    self._deliver(outputs)
                    self._report()
                elif time.monotonic() - self._last_report >= self.config.report_interval_s:
                    self._report()
            if self.tracked:
                log.warning(
                    "worker %s: %d requests left at the drain timeout", self.config.worker_id, len(self.tracked)
                )
            self._hand_back_everything(f"worker {self.config.worker_id} stopped (drain timeout)")
            self._report(fatal="drained on SIGTERM")
        except Exception as e:
            log.exception("worker %s failed", self.config.worker_id)
            self._hand_back_everything(f"worker {self.config.worker_id} failed: {e}")
            self._report(fatal=str(e) or type(e).__name__)
            raise
        finally:
            self.close()

    def _start_draining(self) -> None:
        self.draining = True
        log.info("worker %s draining: %d requests in flight", self.config.worker_id, len(self.tracked))
        self._report()

    def _warm_up(self) -> None:
        """One short generation, so the first real request does not pay for lazy initialization."""
        token = self.engine.tokenizer.bos_token_id or 0
        warmup = GenerateRequest(prompt_ids=[token], sampling=SamplingParams(max_new_tokens=2, ignore_eos=True))
        self.engine.generate([warmup])

    # ---- scheduler messages --------------------------------------------------------------------
    def _take_messages(self, block_s: float) -> None:
        """Handle what the I/O thread received and what it met sending; when idle (`block_s`), first wait
        that long for either, or for a fetch."""
        if not self.io.alive:
            raise RuntimeError("the worker's I/O thread died")
        if block_s:
            self._poller.poll(int(block_s * 1000))
        self._wakeup.clear()
        for source, dispatch in ((self.io.events, self._io_events), (self.io.inbox, self._inbox)):
            while True:
                try:
                    message = source.get_nowait()
                except queue.Empty:
                    break
                if not dispatch(message):
                    self._dropped.warning("scheduler", type(message).__name__, "dropped: not a scheduler message")

    def _on_unsendable(self, event: Unsendable) -> None:
        """A gateway could not take a step's tokens: stop spending compute on its requests."""
        for request_id in event.request_ids:
            if request_id in self.tracked:
                self.engine.abort(request_id)

    def _on_assign(self, assign: Assign) -> None:
        spec = assign.spec
        if spec.request_id in self.tracked:
            self._dropped.warning("scheduler", "Assign", "dropped: %s is already assigned here", spec.request_id)
            return
        tracked = _Tracked(spec, assign.queued_s, time.time(), telemetry.context_from(assign.trace))
        self.tracked[spec.request_id] = tracked
        if self.draining:  # sent before the scheduler saw the draining report
            self._end(spec.request_id, error_status="UNAVAILABLE", error="the worker is draining", retry=True)
            return
        self._send(spec.reply_to, Tokens(spec.request_id, [], self.config.worker_id))  # "it reached a worker"
        key = spec.adapter_key
        cached = Cached.YES if key is None else self.engine.cached(key, spec.adapter_sha256 or None)
        if key is not None:
            metrics.ADAPTER_REQUESTS.labels(self.config.worker_id, self._found(key)).inc()
        if cached is Cached.YES:
            if key is not None:
                tracked.adapter_source = "hit" if self.engine.pool.is_resident(key) else "prefetched"
            self._start(tracked)
            return
        if cached is Cached.STALE_IN_USE:
            message = f"adapter {key[0]} v{key[1]} changed in the store while requests still use the old weights"
            self._end(spec.request_id, error_status="UNAVAILABLE", error=f"{message}; retry shortly")
            return
        tracked.adapter_source = "cold"
        if key not in self.awaiting:
            self.awaiting[key] = []
            self._fetch(key, for_prefetch=False, trace_context=assign.trace)
        elif not self.awaiting[key]:  # only a prefetch of it is queued or under way: it waits for it now
            self._fetches.promote(key)
        self.awaiting[key].append(spec.request_id)

    def _found(self, key: AdapterKey) -> str:
        """How a request's adapter stood when the request arrived (`metrics.ADAPTER_REQUESTS`): resident
        (in the pool, no load for it), ready (a prefetch had loaded it: the load finished before the
        request was scheduled), loading (a fetch or copy was under way), cold (its load starts now)."""
        pool = self.engine.pool
        if pool.is_resident(key):
            ready = pool.slot(key).ready  # a background copy no step has waited for yet
            if ready is None:
                return "resident"
            if not (ready.query() if hasattr(ready, "query") else ready.done()):
                return "loading"
            return "resident" if pool.slot(key).demand else "ready"
        return "loading" if key in self.awaiting else "cold"

    def _start(self, tracked: _Tracked) -> None:
        try:
            tracked.request = self.engine.add_spec(tracked.spec)
        except LoraserveError as e:
            self._end(tracked.spec.request_id, error_status=e.status, error=str(e))

    def _cancel(self, request_id: str, reason: str) -> None:
        tracked = self.tracked.get(request_id)
        if tracked is None:
            return
        if tracked.request is not None:
            self.engine.abort(request_id)  # pages are freed at the next step
        else:
            for waiting in self.awaiting.values():
                if request_id in waiting:
                    waiting.remove(request_id)
            self._end(request_id, error_status="CANCELLED", error=reason or "cancelled")

    def _gateway_gone(self, address: str) -> None:
        """The connection to the gateway at `address` dropped: stop its generations, hand them back."""
        orphans = [rid for rid, tracked in self.tracked.items() if tracked.spec.reply_to == address]
        for request_id in orphans:
            if self.tracked[request_id].request is not None:
                self.engine.abort(request_id)  # pages are freed at the next step; its output is not sent
            for waiting in self.awaiting.values():
                if request_id in waiting:
                    waiting.remove(request_id)
            error = f"the connection from worker {self.config.worker_id} to the gateway was lost"
            self._end(request_id, error_status="UNAVAILABLE", error=error, retry=True)
        if orphans:
            self._dropped.warning(address, "disconnect", "gateway disconnected: stopped %d generations", len(orphans))

    def _on_cancel(self, cancel: Cancel) -> None:
        for request_id in cancel.request_ids:
            self._cancel(request_id, cancel.reason)

    def _on_prefetch(self, prefetch: Prefetch) -> None:
        if not self.engine.config.prefetch:
            return
        keys: list[AdapterKey] = list(prefetch.adapters)
        self.engine.prefetch(keys, prefetch.scores or None)  # remembers the scores, copies what is here
        for key in keys:
            if not self.engine.registry.has(key) and key not in self.awaiting:
                self.awaiting[key] = []
                self._fetch(key, for_prefetch=True, trace_context=prefetch.trace or None)  # a hint's request trace

    # ---- adapter fetching (background threads) -------------------------------------------------
    def _fetch(self, key: AdapterKey, for_prefetch: bool, trace_context: dict | None) -> None:
        self._fetches.submit(key, for_prefetch, trace_context)

    def _register_fetched(self) -> None:
        while True:
            try:
                result = self._fetches.results.get_nowait()
            except queue.Empty:
                return
            waiting = self.awaiting.pop(result.key, [])
            if result.error is not None:
                for request_id in waiting:
                    self._end(request_id, error_status=result.error.status, error=str(result.error))
                continue
            if not self.engine.registry.has(result.key, result.adapter.sha256 or None):
                self.engine.add_adapter(result.key[0], result.adapter, version=result.key[1])
            for request_id in waiting:
                tracked = self.tracked.get(request_id)
                if tracked is not None:
                    tracked.fetch_s = min(result.seconds, time.time() - tracked.received)  # it may have joined late
                    tracked.adapter_transport = result.source
                    self._start(tracked)
            if result.for_prefetch or waiting:  # queued requests make it NEEDED: it may evict any idle one
                self.engine.prefetch([result.key], demand=bool(waiting))

    # ---- deadlines, outputs --------------------------------------------------------------------
    def _expire_deadlines(self) -> None:
        now = time.time()
        for request_id, tracked in list(self.tracked.items()):
            deadline = tracked.spec.deadline
            if deadline is not None and now >= deadline and not tracked.expired:
                tracked.expired = True
                if tracked.request is not None:
                    self.engine.abort(request_id, error="the deadline passed")
                else:
                    self._cancel(request_id, "the deadline passed")

    def _deliver(self, outputs: list[StepOutput]) -> None:
        """A step's news: one STEP_TOKENS per gateway for the requests that go on, a TOKENS per end."""
        going_on: dict[str, list[StepOutput]] = defaultdict(list)  # gateway address -> its requests' tokens
        for out in outputs:
            tracked = self.tracked.get(out.request_id)
            if tracked is None:
                continue
            if not out.finished:
                going_on[tracked.spec.reply_to].append(out)
            elif out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                self._end(out.request_id, output=out)
            elif tracked.expired:
                self._end(
                    out.request_id,
                    error_status="DEADLINE_EXCEEDED",
                    error="the deadline passed on the worker",
                )
            elif out.finish_reason is FinishReason.CANCELLED:
                self._end(out.request_id, error_status="CANCELLED", error="cancelled")
            else:
                self._end(out.request_id, error_status=out.error_status, error=out.error or "failed")
        for address, outs in going_on.items():
            ids = [o.request_id for o in outs]
            message = StepTokens(self.config.worker_id, ids, [o.new_token_ids for o in outs])
            if any(o.logprobs or o.prompt_logprobs for o in outs):
                message.logprobs = [o.logprobs for o in outs]
                message.prompt_logprobs = [o.prompt_logprobs for o in outs]
            if any(o.cached_tokens for o in outs):
                message.cached_tokens = [o.cached_tokens for o in outs]
            self._send(address, message, ids)

    def _end(
        self, request_id: str, error_status=None, error=None, retry=False, output: StepOutput | None = None
    ) -> None:
        """Tell the request's gateway it ended: normally with `output`, the step's output that ended it
        (its last token, finish reason and log-probabilities), else with `error_status`."""
        tracked = self.tracked.pop(request_id, None)
        if tracked is None:
            return
        self.finished_since_report.append(request_id)
        timings = self._timings(tracked)
        message = Tokens(
            request_id,
            list(output.new_token_ids) if output else [],
            self.config.worker_id,
            finished=True,
            finish_reason=str(output.finish_reason) if output else None,
            error_status=error_status,
            error=error,
            retry=retry,
            timings=timings,
            logprobs=output.logprobs if output else [],
            prompt_logprobs=output.prompt_logprobs if output else [],
            cached_tokens=tracked.request.cached_tokens if tracked.request is not None else 0,
        )
        self._send(tracked.spec.reply_to, message)
        self._record_spans(tracked, timings, error_status)

    def _send(self, address: str, message: Tokens | StepTokens, going_on: Sequence[str] = ()) -> None:
        """Push to a gateway (on the I/O thread); if it cannot take it, the requests `going_on` are aborted
        when the I/O thread says so (`_on_unsendable`)."""
        self.io.to_gateway(address, message, going_on)

    def _timings(self, tracked: _Tracked) -> dict[str, float]:
        r = tracked.request
        to_wall = time.time() - time.monotonic()
        timings = {"queue_s": tracked.queued_s, "adapter_load_s": tracked.fetch_s}
        if r is not None and r.first_scheduled is not None:
            timings["queue_s"] += r.first_scheduled + to_wall - tracked.received
            timings["adapter_load_s"] += r.adapter_wait_s
            if r.first_token is not None:
                timings["prefill_s"] = r.first_token - r.first_scheduled
                timings["decode_s"] = (r.finished_at or time.monotonic()) - r.first_token
                timings["first_token_unix"] = r.first_token + to_wall
                timings["first_scheduled_unix"] = r.first_scheduled + to_wall
        return timings

    def _record_spans(self, tracked: _Tracked, timings: dict[str, float], error_status: str | None) -> None:
        tracer = telemetry.tracer()
        received_ns = int(tracked.received * 1e9)
        root = tracer.start_span("worker.request", context=tracked.context, start_time=received_ns)
        root.set_attribute("loraserve.request_id", tracked.spec.request_id)
        root.set_attribute("loraserve.worker_id", self.config.worker_id)
        if error_status:
            root.set_attribute("loraserve.error_status", error_status)
        ctx = trace.set_span_in_context(root)
        if tracked.spec.adapter:
            span = tracer.start_span("worker.adapter_fetch", context=ctx, start_time=received_ns)
            span.set_attribute("loraserve.adapter", f"{tracked.spec.adapter}@{tracked.spec.adapter_version}")
            span.set_attribute("loraserve.adapter.source", tracked.adapter_source)
            if tracked.adapter_transport:
                span.set_attribute("loraserve.adapter.transport", tracked.adapter_transport)
            span.end(end_time=received_ns + int(timings.get("adapter_load_s", 0.0) * 1e9))
        if "first_token_unix" in timings:
            start = int(timings["first_scheduled_unix"] * 1e9)
            first = int(timings["first_token_unix"] * 1e9)
            prefill = tracer.start_span("worker.prefill", context=ctx, start_time=start)
            request = tracked.request
            if request is not None:  # what the prefill did not compute: found cached, or copied from its group
                prefill.set_attribute("loraserve.prompt_tokens", len(request.prompt_ids))
                prefill.set_attribute("loraserve.cached_tokens", request.cached_tokens)
                prefill.set_attribute("loraserve.shared_prefill_tokens", request.shared_prefill_tokens)
            prefill.end(end_time=first)
            tracer.start_span("worker.decode", context=ctx, start_time=first).end(end_time=time.time_ns())
        root.end()

    # ---- reports -------------------------------------------------------------------------------
    def _sample_step(self, seconds: float) -> None:
        """Keep the step's composition and time for the next report (the scheduler fits its cost model
        to them); past MAX_STEP_SAMPLES between reports, the oldest go."""
        shape = self.engine.last_step
        if shape is not None:
            self.step_samples.append((*shape, min(seconds, 3600.0)))
            del self.step_samples[:-MAX_STEP_SAMPLES]

    def _report(self, fatal: str | None = None) -> None:
        e = self.engine
        pool = e.pool.page_stats()
        stats = e.pool.stats
        parked = [rid for waiting in self.awaiting.values() for rid in waiting]
        report = WorkerReport(
            worker_id=self.config.worker_id,
            ready=self.ready and fatal is None,
            max_batch_size=e.config.max_batch_size,
            total_pages=pool.total_pages,
            free_pages=pool.free_pages,
            kv_pages=pool.kv_pages,
            adapter_pages=pool.adapter_pages,
            running=[r.request_id for r in e.step_scheduler.running],
            waiting=[r.request_id for r in e.step_scheduler.waiting] + parked,
            resident=[list(k) for k in e.pool.resident_adapters()[-MAX_RESIDENT:]],  # the most recently used
            finished=self.finished_since_report,
            evictable_pages=e.pool.evictable_pages() + pool.cached_pages,
            cached_pages=pool.cached_pages,
            tokens_per_page=e.layout.tokens_per_page,
            steps=e.steps,
            prefetch_hits=stats.prefetch_hits,
            prefetch_misses=stats.misses + stats.prefetch_late,
            waste_fraction=pool.waste_fraction,
            fatal=fatal,
            instance=self.instance,
            draining=self.draining,
            step_samples=self.step_samples,
            cached_prefixes=self._cached_prefixes(),
        )
        self.io.to_scheduler(report)
        self.last_report = report  # one reference swap: safe for the scrape thread
        self.finished_since_report = []
        self.step_samples = []
        self._last_report = time.monotonic()

    def _cached_prefixes(self) -> bytes | None:
        """The pool's cached-prefix fingerprints when they changed (at most every PREFIXES_MIN_S), and
        every PREFIXES_RESEND_S in any case (a scheduler that restarted learns them); else None."""
        epoch, now = self.engine.pool.prefix_epoch, time.monotonic()
        sent_epoch, sent_at = self._prefixes_sent
        if now - sent_at < (PREFIXES_MIN_S if epoch != sent_epoch else PREFIXES_RESEND_S):
            return None
        self._prefixes_sent = epoch, now
        return b"".join(self.engine.pool.cached_prefixes(MAX_PREFIXES))

    def _hand_back_everything(self, message: str) -> None:
        """End every request here as lost with this worker: each gateway fails its own over elsewhere."""
        for request_id in list(self.tracked):
            self._end(request_id, error_status="UNAVAILABLE", error=message, retry=True)

    def close(self) -> None:
        self._fetches.close()
        self.io.close(linger_ms=200)
        self._wakeup.close()
        self.ctx.term()
        self.engine.close()
