"""The worker's decisions, without I/O: what to do with each request the scheduler places here.

`WorkerCore` is told things as plain values — the scheduler's messages already decoded (ASSIGN /
CANCEL / PREFETCH), the I/O thread's news (`Unsendable`, `GatewayGone`), a finished adapter fetch or
matcher build, a step's outputs, the time (`Now`) — and answers each with a list of effects
(`worker/effects.py`): messages to send, requests to start or abort in the engine, fetches and builds
to start, a report. It reads no clock, touches no socket or thread and changes no engine state: the loop
(`worker/service.py`) carries the effects out, in order. Of the engine it asks three questions
(`EngineAnswers`), and the loop tells it how a `Start` went (`started` / `start_failed`).

The rules it holds:

- Every ASSIGN is acknowledged to its gateway at once (an empty TOKENS naming this worker), so the
  gateway knows the request left the scheduler; a duplicate is dropped, and one that arrives while the
  worker drains is handed back (UNAVAILABLE, retry). An ASSIGN may continue a request another worker
  started (`output_ids`: failover); the engine recomputes those tokens and goes on.
- A request with structured output is parked while its llguidance matcher is built off the step loop
  (`Build`, `worker/guide_builds.py`), then goes on to its adapter as any request; a build that fails
  ends only its own request.
- A request whose adapter the engine holds starts; one whose adapter changed in the store while
  requests still use the old weights ends UNAVAILABLE; any other is parked on its adapter's fetch
  (`parked.py`). A PREFETCH copies the predicted adapters the engine holds into the pool and fetches
  the others; a fetched adapter is registered, its parked requests start (or end with the fetch's
  error), and it is copied into the pool in the background.
- CANCEL, and a passed deadline, abort a running request (the engine ends it at its next step) or end a
  waiting one at once. A gateway that cannot take tokens (`Unsendable`) has its requests aborted; one
  whose connection dropped (`GatewayGone`) has every request streaming to it stopped and handed back
  (UNAVAILABLE, retry), so a live gateway fails it over and a dead one's generations stop.
- After a step, one STEP_TOKENS per gateway for the requests that go on and one TOKENS per request that
  ends, with its timings; then a report. When idle, a report every `report_interval_s`.
- Stopping drains: the worker reports `draining` (the scheduler places nothing more here), finishes what
  it holds for up to `drain_timeout_s`, then hands what is left back to the gateways to fail over.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loraserve import telemetry
from loraserve.errors import LoraserveError
from loraserve.log_limit import RateLimitedLog
from loraserve.wire import AdapterKey, Assign, Cancel, Prefetch, Tokens
from loraserve.worker.effects import (
    Abort,
    AdapterRequested,
    Build,
    CopyIn,
    Effect,
    Ended,
    Forget,
    GatewayGone,
    Now,
    Register,
    Report,
    Send,
    Start,
    Unsendable,
)
from loraserve.worker.engine import Cached
from loraserve.worker.parked import ParkedRequests
from loraserve.worker.replies import end_tokens, ending, step_tokens
from loraserve.worker.request import Request
from loraserve.worker.step_results import StepOutput
from loraserve.worker.tracked import Tracked

if TYPE_CHECKING:
    from loraserve.worker.fetch_threads import Fetched
    from loraserve.worker.guide_builds import BuiltGuide

log = logging.getLogger(__name__)


def _collected(rule: Callable[..., None]) -> Callable[..., list[Effect]]:
    """A rule of the core, which appends its effects to `_out`, as a method that returns them."""

    @functools.wraps(rule)
    def collect(self: WorkerCore, *args: Any) -> list[Effect]:
        self._out = []
        rule(self, *args)
        out, self._out = self._out, []
        return out

    return collect


@dataclass(frozen=True)
class EngineAnswers:
    """What the core asks the engine about an adapter (the loop passes the engine's own methods)."""

    cached: Callable[[AdapterKey, str | None], Cached]  # `Engine.cached`: held with these weights?
    standing: Callable[[AdapterKey], str | None]  # `UnifiedPool.standing`: resident | ready | loading | None
    holds: Callable[..., bool]  # `AdapterRegistry.has(key, sha256=None)`


class WorkerCore:
    """The rules for the requests on one worker (see the module docstring): plain values in, effects out."""

    def __init__(
        self,
        worker_id: str,
        engine: EngineAnswers,
        prefetch: bool,
        report_interval_s: float,
        drain_timeout_s: float,
    ) -> None:
        self.worker_id, self.engine, self.prefetch_on = worker_id, engine, prefetch
        self.report_interval_s, self.drain_timeout_s = report_interval_s, drain_timeout_s
        self.tracked: dict[str, Tracked] = {}
        self.parked = ParkedRequests()  # requests waiting for their adapter's fetch
        self.building: dict[str, None] = {}  # ... for their matcher's build, in arrival order
        self.finished: list[str] = []  # requests ended since the last report
        self.ready = self.draining = False
        self.drain_deadline: float | None = None  # monotonic
        self.last_report = float("-inf")  # monotonic
        self._dropped = RateLimitedLog(log)
        self._out: list[Effect] = []
        self._inputs: dict[type, Callable[[Any, Now], None]] = {
            Assign: self._assign,
            Cancel: self._cancel_all,
            Prefetch: self._prefetch,
            Unsendable: self._unsendable,
            GatewayGone: self._gateway_gone,
        }

    # ---- what the loop tells it ------------------------------------------------------------------
    @_collected
    def take(self, message: object, now: Now) -> None:
        """A scheduler message (ASSIGN / CANCEL / PREFETCH) or an I/O thread's news."""
        handler = self._inputs.get(type(message))
        if handler is None:
            self._dropped.warning("scheduler", type(message).__name__, "dropped: not a scheduler message")
            return
        handler(message, now)

    def started(self, request_id: str, request: Request) -> None:
        """The engine queued the request (`Start`)."""
        self.tracked[request_id].request = request

    @_collected
    def start_failed(self, request_id: str, error: LoraserveError, now: Now) -> None:
        self._end(request_id, now, error.status, str(error))

    # ---- reports and the worker's life -----------------------------------------------------------
    def report(self, now: Now, fatal: str | None = None) -> list[Effect]:
        waiting = self.parked.parked() + list(self.building)
        finished, self.finished = self.finished, []
        self.last_report = now.mono
        return [Report(self.ready, self.draining, waiting, finished, fatal)]

    def idle(self, now: Now) -> list[Effect]:
        """No step to run: a report if none went out for `report_interval_s`."""
        return self.report(now) if now.mono - self.last_report >= self.report_interval_s else []

    def become_ready(self, now: Now) -> list[Effect]:
        self.ready = True
        return self.report(now)

    def drain(self, now: Now) -> list[Effect]:
        """Stop taking requests; those here may finish for `drain_timeout_s`."""
        self.draining = True
        self.drain_deadline = now.mono + self.drain_timeout_s
        log.info("worker %s draining: %d requests in flight", self.worker_id, len(self.tracked))
        return self.report(now)

    def going(self, now: Now) -> bool:
        """Whether the loop goes on: not draining, or requests left and the drain's time not up."""
        return self.drain_deadline is None or (bool(self.tracked) and now.mono < self.drain_deadline)

    @_collected
    def stop(self, now: Now, error: Exception | None = None) -> None:
        """The last effects: every request left handed back to fail over, and a report that drops the worker."""
        if error is None and self.tracked:
            log.warning("worker %s: %d requests left at the drain timeout", self.worker_id, len(self.tracked))
        why = "stopped (drain timeout)" if error is None else f"failed: {error}"
        for request_id in list(self.tracked):  # each gateway fails its own over elsewhere
            self._end(request_id, now, "UNAVAILABLE", f"worker {self.worker_id} {why}", retry=True)
        self._out += self.report(now, "drained on SIGTERM" if error is None else str(error) or type(error).__name__)

    # ---- the rules -------------------------------------------------------------------------------
    def _assign(self, assign: Assign, now: Now) -> None:
        spec = assign.spec
        if spec.request_id in self.tracked:
            self._dropped.warning("scheduler", "Assign", "dropped: %s is already assigned here", spec.request_id)
            return
        tracked = Tracked(spec, assign.queued_s, now.wall, telemetry.context_from(assign.trace))
        self.tracked[spec.request_id] = tracked
        if self.draining:  # sent before the scheduler saw the draining report
            self._end(spec.request_id, now, "UNAVAILABLE", "the worker is draining", retry=True)
            return
        self._out.append(Send(spec.reply_to, Tokens(spec.request_id, [], self.worker_id)))  # "it reached a worker"
        tracked.trace = assign.trace
        if spec.sampling.grammar is not None:  # parked until its matcher is built off the step loop
            self.building[spec.request_id] = None
            self._out.append(Build(spec.request_id, spec.sampling.grammar, spec.output_ids))
            return
        self._to_adapter(tracked, now)

    def _to_adapter(self, tracked: Tracked, now: Now) -> None:
        """Start the request if its adapter is here, else park it on the adapter's fetch."""
        spec = tracked.spec
        key = spec.adapter_key
        if key is None:
            self._out.append(Start(spec, tracked.guide))
            return
        cached = self.engine.cached(key, spec.adapter_sha256 or None)
        standing = self.engine.standing(key)
        self._out.append(AdapterRequested(standing or ("loading" if self.parked.fetching(key) else "cold")))
        if cached is Cached.YES:
            tracked.adapter_source = "prefetched" if standing is None else "hit"
            self._out.append(Start(spec, tracked.guide))
        elif cached is Cached.STALE_IN_USE:
            message = f"adapter {key[0]} v{key[1]} changed in the store while requests still use the old weights"
            self._end(spec.request_id, now, "UNAVAILABLE", f"{message}; retry shortly")
        else:
            tracked.adapter_source = "cold"
            fetch = self.parked.park(spec.request_id, key, tracked.trace)
            self._out += [fetch] if fetch is not None else []

    @_collected
    def built(self, built: BuiltGuide, now: Now) -> None:
        """A matcher build finished: its request goes on to its adapter, or ends with the build's error."""
        self.building.pop(built.request_id, None)
        tracked = self.tracked.get(built.request_id)
        if tracked is None:
            return
        if built.error is not None:
            self._end(built.request_id, now, built.error.status, str(built.error))
            return
        tracked.guide = built.matcher
        self._to_adapter(tracked, now)

    @_collected
    def fetched(self, result: Fetched, now: Now) -> None:
        """An adapter fetch finished: register the adapter and start its parked requests, or end them."""
        waiting = self.parked.land(result.key)
        if result.error is not None:
            for request_id in waiting:
                self._end(request_id, now, result.error.status, str(result.error))
            return
        if not self.engine.holds(result.key, result.adapter.sha256 or None):
            self._out.append(Register(result.key, result.adapter))
        for request_id in waiting:
            tracked = self.tracked.get(request_id)
            if tracked is not None:
                tracked.fetch_s = min(result.seconds, now.wall - tracked.received)  # it may have joined late
                tracked.adapter_transport = result.source
                self._out.append(Start(tracked.spec, tracked.guide))
        if result.for_prefetch or waiting:  # queued requests make it NEEDED: it may evict any idle one
            self._out.append(CopyIn([result.key], demand=bool(waiting)))

    def _prefetch(self, prefetch: Prefetch, now: Now) -> None:
        if not self.prefetch_on:
            return
        keys: list[AdapterKey] = list(prefetch.adapters)
        self._out.append(CopyIn(keys, prefetch.scores or None))  # remembers the scores, copies what is here
        self._out += self.parked.prefetch(keys, prefetch.trace or None, self.engine.holds)

    def _cancel_all(self, cancel: Cancel, now: Now) -> None:
        for request_id in cancel.request_ids:
            self._cancel(request_id, cancel.reason, now)

    def _cancel(self, request_id: str, reason: str, now: Now) -> None:
        tracked = self.tracked.get(request_id)
        if tracked is None:
            return
        if tracked.request is not None:
            self._out.append(Abort(request_id))  # pages are freed at the next step
        else:
            self.parked.unpark(request_id)
            self._end(request_id, now, "CANCELLED", reason or "cancelled")

    def _unsendable(self, event: Unsendable, now: Now) -> None:
        """A gateway could not take a step's tokens: stop spending compute on its requests."""
        self._out += [Abort(rid) for rid in event.request_ids if rid in self.tracked]

    def _gateway_gone(self, event: GatewayGone, now: Now) -> None:
        """The connection to a gateway dropped: stop its generations, hand them back."""
        address = event.address
        orphans = [rid for rid, tracked in self.tracked.items() if tracked.spec.reply_to == address]
        for request_id in orphans:
            if self.tracked[request_id].request is not None:
                self._out.append(Abort(request_id))  # pages are freed at the next step; its output is not sent
            self.parked.unpark(request_id)
            error = f"the connection from worker {self.worker_id} to the gateway was lost"
            self._end(request_id, now, "UNAVAILABLE", error, retry=True)
        if orphans:
            self._dropped.warning(address, "disconnect", "gateway disconnected: stopped %d generations", len(orphans))

    @_collected
    def expire(self, now: Now) -> None:
        """Stop the requests whose deadline passed."""
        for request_id, tracked in list(self.tracked.items()):
            deadline = tracked.spec.deadline
            if deadline is not None and now.wall >= deadline and not tracked.expired:
                tracked.expired = True
                if tracked.request is not None:
                    self._out.append(Abort(request_id, "the deadline passed"))
                else:
                    self._cancel(request_id, "the deadline passed", now)

    @_collected
    def deliver(self, outputs: list[StepOutput], now: Now) -> None:
        """A step's news: one STEP_TOKENS per gateway for the requests that go on, a TOKENS per end."""
        going_on: dict[str, list[StepOutput]] = defaultdict(list)  # gateway address -> its requests' tokens
        for out in outputs:
            tracked = self.tracked.get(out.request_id)
            if tracked is not None and not out.finished:
                going_on[tracked.spec.reply_to].append(out)
            elif tracked is not None:
                status, error = ending(out, tracked.expired)
                self._end(out.request_id, now, status, error, output=None if status else out)
        for address, outs in going_on.items():
            message = step_tokens(self.worker_id, outs)
            self._out.append(Send(address, message, message.request_ids))

    def _end(
        self,
        request_id: str,
        now: Now,
        error_status: str | None = None,
        error: str | None = None,
        retry: bool = False,
        output: StepOutput | None = None,
    ) -> None:
        """Tell the request's gateway it ended (`replies.end_tokens`), and record its spans."""
        tracked = self.tracked.pop(request_id, None)
        if tracked is None:
            return
        if request_id in self.building:  # it was waiting for its matcher
            del self.building[request_id]
            self._out.append(Forget(request_id))
        self.finished.append(request_id)
        timings = tracked.timings(now.wall, now.mono)
        message = end_tokens(self.worker_id, tracked, timings, output, error_status, error, retry)
        self._out += [Send(tracked.spec.reply_to, message), Ended(tracked, timings, error_status)]
