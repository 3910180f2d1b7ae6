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

A request with structured output is parked while its llguidance matcher is built, and its first mask
computed, on a small thread pool (`worker/guide_builds.py`), then goes on to its adapter as any
request: a costly grammar never holds the step loop, and one that fails (invalid, or over llguidance's
limits) ends only its own request, INVALID_ARGUMENT. The llguidance tokenizer is built during the
warm-up, before the worker reports ready.

Liveness does not depend on the step loop: the I/O thread sends the scheduler a heartbeat every
`heartbeat_interval_s`, with how long the step under way has run, however long that step is.

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

from loraserve import telemetry
from loraserve.dispatch import Dispatcher
from loraserve.errors import InvalidConfigError, LoraserveError
from loraserve.internal_auth import Curve, InternalKeys
from loraserve.log_limit import RateLimitedLog
from loraserve.params import SamplingParams
from loraserve.wire import (
    Assign,
    Cancel,
    Prefetch,
    StepTokens,
    Tokens,
    WorkerReport,
)
from loraserve.worker import metrics
from loraserve.worker.engine import Cached, Engine, GenerateRequest, StepOutput
from loraserve.worker.fetch_threads import FetchConfig, Fetched, FetchThreads, Wakeup
from loraserve.worker.guide_builds import GuideBuilds
from loraserve.worker.io_thread import GatewayGone, Unsendable, WorkerIO
from loraserve.worker.parked import ParkedRequests
from loraserve.worker.replies import end_tokens, ending, step_tokens
from loraserve.worker.reporter import Reporter
from loraserve.worker.tracked import Tracked

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    scheduler_address: str = "tcp://127.0.0.1:7101"
    store_address: str = "tcp://127.0.0.1:7301"
    report_interval_s: float = 0.25  # a report this often when idle (a busy worker reports after every step)
    heartbeat_interval_s: float = 0.25  # the I/O thread's heartbeats, whatever the step loop does
    grammar_threads: int = 2  # threads building structured-output matchers off the step loop
    fetch_timeout_s: float = 10.0
    fetch_threads: int = 2
    drain_timeout_s: float = 30.0  # on SIGTERM: how long requests in flight may take to finish here
    keys: InternalKeys | None = None  # CURVE keys: talk to the scheduler, store and gateways as a worker
    adapter_rows: bool = True  # fetch adapters in the pool's row layout (`worker/fetch_threads.py`)
    shm_root: Path | None = Path("/dev/shm")  # map rows from a store on this host; None: over the socket only
    verify_shared_memory: bool = False  # hash mapped rows too (`loraserve/shared_rows.py` says why it is off)

    def __post_init__(self) -> None:
        if not (self.report_interval_s > 0 and self.heartbeat_interval_s > 0 and self.grammar_threads >= 1):
            raise InvalidConfigError(
                "the report and heartbeat intervals must be positive and grammar_threads at least 1: "
                f"{self.report_interval_s}, {self.heartbeat_interval_s}, {self.grammar_threads}"
            )

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


def warm_up(engine: Engine, guides: GuideBuilds) -> None:
    """One short generation, and structured output's llguidance tokenizer, a matcher (on the build pool) and
    a mask (on the mask thread), so the first real request, structured or not, pays for no lazy initialization."""
    token = engine.tokenizer.bos_token_id or 0
    warmup = GenerateRequest(prompt_ids=[token], sampling=SamplingParams(max_new_tokens=2, ignore_eos=True))
    engine.generate([warmup])
    try:
        matcher = guides.warm_up()
    except Exception:  # the worker still serves; each structured request then fails alone, saying why
        log.exception("structured output could not be prepared (llguidance with this model's tokenizer)")
        return
    engine.runner.masks.wait(engine.runner.masks.start([matcher]))


class WorkerService:
    """The worker process's one loop: scheduler messages in, engine steps, tokens out, reports back.

    Owns per-request delivery (gateway address, timings, trace) and the adapter fetches in flight;
    the engine owns everything about the requests themselves (see the module docstring).
    """

    def __init__(self, engine: Engine, config: WorkerConfig):
        self.engine, self.config = engine, config
        self.ctx = zmq.Context()
        self._dropped = RateLimitedLog(log)
        self.tracked: dict[str, Tracked] = {}
        self._wakeup = Wakeup()  # the I/O, fetch and build threads wake the loop when something arrives
        self.instance = uuid.uuid4().hex  # tells the scheduler a restarted worker from the process it replaced
        self.io = WorkerIO(
            self.ctx,
            config.scheduler_address,
            config.worker_id,
            self._wakeup,
            config.curve_to("scheduler"),
            config.curve_to("gateway"),
            instance=self.instance,
            heartbeat_s=config.heartbeat_interval_s,
        )
        self._fetches = FetchThreads(config.fetching(), engine, self._wakeup)
        self.parked = ParkedRequests(engine, self._fetches)  # requests waiting for their adapter's fetch
        self.guides = GuideBuilds(engine.grammars, self._wakeup, config.grammar_threads)  # ... for their matcher
        self._poller = zmq.Poller()
        self._poller.register(self._wakeup.fd, zmq.POLLIN)
        self.ready = False
        self.draining = False
        self._step_seconds = metrics.STEP_SECONDS.labels(config.worker_id)
        self.last_report: WorkerReport | None = None  # read by the metrics endpoint's thread
        self.reporter = Reporter(engine, config.worker_id, self.instance)
        self._inbox = Dispatcher({Assign: self._on_assign, Cancel: self._on_cancel, Prefetch: self._on_prefetch})
        self._io_events = Dispatcher(
            {Unsendable: self._on_unsendable, GatewayGone: lambda event: self._gateway_gone(event.address)}
        )

    # ---- main loop -----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self._report()  # register (not ready yet; the I/O thread's heartbeats keep it while it warms up)
        warm_up(self.engine, self.guides)
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
                self._admit_built()
                self._expire_deadlines()
                if self.engine.has_unfinished():
                    self.io.step_started = time.monotonic()
                    started = time.perf_counter()
                    try:
                        outputs = self.engine.step()
                    finally:
                        self.io.step_started = None
                    seconds = time.perf_counter() - started
                    self._step_seconds.observe(seconds)
                    self.reporter.sample_step(seconds)
                    self._deliver(outputs)
                    self._report()
                elif time.monotonic() - self.reporter.last_sent >= self.config.report_interval_s:
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
        tracked = Tracked(spec, assign.queued_s, time.time(), telemetry.context_from(assign.trace))
        self.tracked[spec.request_id] = tracked
        if self.draining:  # sent before the scheduler saw the draining report
            self._end(spec.request_id, error_status="UNAVAILABLE", error="the worker is draining", retry=True)
            return
        self._send(spec.reply_to, Tokens(spec.request_id, [], self.config.worker_id))  # "it reached a worker"
        tracked.trace = assign.trace
        if spec.sampling.grammar is not None:  # parked until its matcher is built off the step loop
            self.guides.submit(spec.request_id, spec.sampling.grammar, spec.output_ids)
            return
        self._to_adapter(tracked)

    def _to_adapter(self, tracked: Tracked) -> None:
        """Start the request if its adapter is here, else park it on the adapter's fetch."""
        spec = tracked.spec
        key = spec.adapter_key
        cached = Cached.YES if key is None else self.engine.cached(key, spec.adapter_sha256 or None)
        if key is not None:
            metrics.ADAPTER_REQUESTS.labels(self.config.worker_id, self.parked.found(key)).inc()
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
        self.parked.park(spec.request_id, key, tracked.trace)

    def _admit_built(self) -> None:
        """Requests whose matcher was built go on to their adapter; those whose build failed end (only they)."""
        for built in self.guides.take():
            tracked = self.tracked.get(built.request_id)
            if tracked is None:
                continue
            if built.error is not None:
                self._end(built.request_id, error_status=built.error.status, error=str(built.error))
                continue
            tracked.guide = built.matcher
            self._to_adapter(tracked)

    def _start(self, tracked: Tracked) -> None:
        try:
            tracked.request = self.engine.add_spec(tracked.spec, tracked.guide)
        except LoraserveError as e:
            self._end(tracked.spec.request_id, error_status=e.status, error=str(e))

    def _cancel(self, request_id: str, reason: str) -> None:
        tracked = self.tracked.get(request_id)
        if tracked is None:
            return
        if tracked.request is not None:
            self.engine.abort(request_id)  # pages are freed at the next step
        else:
            self.parked.unpark(request_id)
            self._end(request_id, error_status="CANCELLED", error=reason or "cancelled")

    def _gateway_gone(self, address: str) -> None:
        """The connection to the gateway at `address` dropped: stop its generations, hand them back."""
        orphans = [rid for rid, tracked in self.tracked.items() if tracked.spec.reply_to == address]
        for request_id in orphans:
            if self.tracked[request_id].request is not None:
                self.engine.abort(request_id)  # pages are freed at the next step; its output is not sent
            self.parked.unpark(request_id)
            error = f"the connection from worker {self.config.worker_id} to the gateway was lost"
            self._end(request_id, error_status="UNAVAILABLE", error=error, retry=True)
        if orphans:
            self._dropped.warning(address, "disconnect", "gateway disconnected: stopped %d generations", len(orphans))

    def _on_cancel(self, cancel: Cancel) -> None:
        for request_id in cancel.request_ids:
            self._cancel(request_id, cancel.reason)

    def _on_prefetch(self, prefetch: Prefetch) -> None:
        if self.engine.config.prefetch:
            self.parked.prefetch(prefetch)

    def _register_fetched(self) -> None:
        """Start the requests whose adapter arrived; end those whose fetch failed."""

        def start(request_id: str, fetched: Fetched) -> None:
            tracked = self.tracked.get(request_id)
            if tracked is not None:
                tracked.fetch_s = min(fetched.seconds, time.time() - tracked.received)  # it may have joined late
                tracked.adapter_transport = fetched.source
                self._start(tracked)

        def fail(request_id: str, error: LoraserveError) -> None:
            self._end(request_id, error_status=error.status, error=str(error))

        self.parked.land(start, fail)

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
                continue
            status, error = ending(out, tracked.expired)
            self._end(out.request_id, error_status=status, error=error, output=None if status else out)
        for address, outs in going_on.items():
            message = step_tokens(self.config.worker_id, outs)
            self._send(address, message, message.request_ids)

    def _end(
        self, request_id: str, error_status=None, error=None, retry=False, output: StepOutput | None = None
    ) -> None:
        """Tell the request's gateway it ended (`replies.end_tokens`), and record its spans."""
        tracked = self.tracked.pop(request_id, None)
        if tracked is None:
            return
        self.guides.cancel(request_id)  # if it was waiting for its matcher
        self.reporter.finished.append(request_id)
        timings = tracked.timings()
        message = end_tokens(self.config.worker_id, tracked, timings, output, error_status, error, retry)
        self._send(tracked.spec.reply_to, message)
        tracked.record_spans(self.config.worker_id, timings, error_status)

    def _send(self, address: str, message: Tokens | StepTokens, going_on: Sequence[str] = ()) -> None:
        """Push to a gateway (on the I/O thread); if it cannot take it, the requests `going_on` are aborted
        when the I/O thread says so (`_on_unsendable`)."""
        self.io.to_gateway(address, message, going_on)

    # ---- reports -------------------------------------------------------------------------------
    def _report(self, fatal: str | None = None) -> None:
        report = self.reporter.report(self.ready, self.draining, self.parked.parked() + self.guides.pending(), fatal)
        self.io.to_scheduler(report)
        self.last_report = report  # one reference swap: safe for the scrape thread

    def _hand_back_everything(self, message: str) -> None:
        """End every request here as lost with this worker: each gateway fails its own over elsewhere."""
        for request_id in list(self.tracked):
            self._end(request_id, error_status="UNAVAILABLE", error=message, retry=True)

    def close(self) -> None:
        self.guides.close()
        self._fetches.close()
        self.io.close(linger_ms=200)
        self._wakeup.close()
        self.ctx.term()
        self.engine.close()
