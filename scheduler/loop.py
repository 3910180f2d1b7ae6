"""The scheduler process's I/O: gRPC for gateways, ZMQ for workers, around the pure policy.

All state changes happen on one asyncio loop: a gRPC call or a worker message updates the
policy, then `_run_round` executes the policy's decisions (send ASSIGN / CANCEL / PREFETCH to
workers, tell gateways about failures). A timer runs a round every `tick_s` even when nothing
arrives, so dead workers and expired deadlines are noticed. A monitor on the workers' socket
turns a disconnect (a killed worker's TCP connection closing) into a probe of every worker, so a
dead one is dropped at once instead of after `worker_timeout_s` (a stopped one, whose connection
stays open, is caught by its silence: a live worker's I/O thread sends a heartbeat every 0.25 s,
however long its step, and any message keeps it). Silence is counted only while this loop listens:
rounds more than `STALL_S` apart mean the process did not run (paused, starved, a clock step), and
that gap is nobody's silence, so a stalled scheduler does not drop its live workers when it resumes.
The monitor is drained as fast as events come and probes are coalesced, at most one round per
`PROBE_INTERVAL_S` (`scheduler/disconnects.py`): connection churn from strangers costs the scheduler a
bounded amount of work and never stalls the workers' socket.

Nothing from outside reaches the policy unchecked: a Submit arrives as its `RequestSpec`, built and
checked by the Submit servicer (`scheduler/submit.py`) against the same limits a worker's decoder
will apply to the ASSIGN that carries it, and worker messages are checked by `wire.decode`; a bad
one is logged (rate-limited per peer and kind) and dropped. A worker speaks only for itself (its
worker id is its connection's routing identity), at most `max_workers` register, and a turn of worker
messages is bounded in count and time (`scheduler/worker_inbox.py`), so a flood of reports cannot stall
the loop. The
receive task and the round task run under `loraserve.supervise.run_tasks`: if either dies, `run`
raises instead of leaving a zombie.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass, replace

import zmq
import zmq.asyncio
from opentelemetry import trace

from loraserve import telemetry
from loraserve.dispatch import Dispatcher
from loraserve.endpoints import BadEndpointError
from loraserve.errors import InvalidRequestError
from loraserve.internal_auth import InternalKeys
from loraserve.log_limit import RateLimitedLog
from loraserve.request_spec import RequestSpec
from loraserve.scheduler import metrics
from loraserve.scheduler.disconnects import DisconnectWatch, WorkerProbes
from loraserve.scheduler.hints import AdapterHints
from loraserve.scheduler.policy import (
    AssignTo,
    CancelOn,
    Decision,
    Fail,
    Migrate,
    PrefetchOn,
    QueuedRequest,
    SchedulerPolicy,
    WorkerGone,
)
from loraserve.scheduler.quotas import QuotaExceededError, TokenQuotas
from loraserve.scheduler.submit import check_hint, queued_from_spec
from loraserve.scheduler.worker_inbox import MAX_WORKER_MESSAGE_BYTES, WORKER_QUEUE, WorkerInbox
from loraserve.sockets import PushSockets, make_socket, send, sent_or_raise
from loraserve.supervise import run_tasks
from loraserve.v1 import scheduler_pb2
from loraserve.wire import Assign, Cancel, Heartbeat, Prefetch, Tokens, WorkerReport

log = logging.getLogger(__name__)
STALL_S = 1.0  # rounds (every tick_s, 0.05 s) this far apart: the loop did not run, nor read the workers


@dataclass
class _Pending:
    """What the loop keeps per queued request besides the policy's view."""

    spec: RequestSpec  # as the Submit servicer built it; the ASSIGN carries it unchanged
    span: trace.Span  # "scheduler.queue", ended at placement


class SchedulerLoop:
    """The scheduler's I/O around the pure policy: Submits and Cancels in, worker reports in,
    the policy's decisions out as ASSIGN / CANCEL / PREFETCH to workers and failures to gateways."""

    def __init__(
        self, policy: SchedulerPolicy, worker_address: str, tick_s: float = 0.05, keys: InternalKeys | None = None
    ):
        self.policy = policy
        self.ctx = zmq.asyncio.Context()
        # With internal keys: only workers may connect, and failures go only to real gateways.
        self._auth = keys.authenticator(self.ctx) if keys is not None else None
        try:
            self.workers = make_socket(
                self.ctx,
                zmq.ROUTER,
                bind=worker_address,
                curve=keys.server() if keys is not None else None,
                rcvhwm=WORKER_QUEUE,  # a flood waits at its sender
                max_message_bytes=MAX_WORKER_MESSAGE_BYTES,
            )
        except BaseException:
            self._stop_auth()
            raise
        self.gateways = PushSockets(self.ctx, curve=keys.client_of("gateway") if keys is not None else None)
        self.pending: dict[str, _Pending] = {}
        self.quotas = TokenQuotas()  # each tenant's tokens_per_minute, for every gateway at once
        self.hints = AdapterHints()  # gateways' early word of the adapters requests will need
        self.tick_s = tick_s
        self.instance = uuid.uuid4().hex  # in ClusterState: gateways tell a restarted scheduler by it
        self._wake = asyncio.Event()
        self._round_s = 0.0  # how long the last scheduling round took
        self._dropped = RateLimitedLog(log)
        self._disconnects = DisconnectWatch(self.ctx, self.workers)
        self._probes = WorkerProbes(lambda: policy.workers, lambda worker: self._to_worker(worker, Cancel([], "probe")))
        self.inbox = WorkerInbox(
            self.workers,
            Dispatcher({WorkerReport: self._on_report, Heartbeat: self._on_heartbeat}),
            registered=policy.workers,
            max_workers=lambda: policy.cluster.config.max_workers,
            turn_ended=self._turn_ended,
        )
        self._decide = Dispatcher(
            {
                AssignTo: self._assign,
                CancelOn: lambda d: self._to_worker(d.worker_id, Cancel(list(d.request_ids), d.reason)),
                PrefetchOn: self._prefetch,
                Migrate: self._migrate,
                Fail: lambda d: self._fail(d.request, d.status, d.message, d.retry),
                WorkerGone: lambda d: log.warning("%s", d.reason),
            }
        )

    # ---- gRPC entry points (called by service.py) ----------------------------------------------
    def submit(self, spec: RequestSpec, tokens_per_minute: int, metadata, request_cost: int = 0) -> int:
        """Queue a request the Submit servicer turned into its spec (`scheduler/submit.py`); its position.
        `request_cost`: its whole client request's token cost, charged once per `spec.request_key` (0: alone)."""
        if spec.request_id in self.pending or spec.request_id in self.policy.placed:
            raise InvalidRequestError("request_id", f"{spec.request_id!r} is already in use")
        now = time.time()
        max_new_tokens = spec.sampling.max_new_tokens
        cost = 0 if spec.attempt else len(spec.prompt_ids) + max_new_tokens  # attempts: charged once
        group = (spec.request_key, 0 if spec.attempt else request_cost)
        try:
            charged = self.quotas.charge(spec.tenant, tokens_per_minute, cost, now, group=group)
        except QuotaExceededError:
            metrics.REFUSED.labels("RESOURCE_EXHAUSTED").inc()
            raise
        queued = queued_from_spec(spec)
        span = telemetry.tracer().start_span("scheduler.queue", context=telemetry.context_from(metadata))
        span.set_attribute("loraserve.request_id", spec.request_id)
        try:
            position = self.policy.add(queued, now, resumed=spec.attempt > 0)
        except Exception as e:
            self.quotas.refund(spec.tenant, tokens_per_minute, charged, now, group=group, refusal=e)
            metrics.REFUSED.labels(getattr(e, "status", "INTERNAL")).inc()
            span.record_exception(e)
            span.end()
            raise
        span.set_attribute("loraserve.queue_position", position)
        self.pending[spec.request_id] = _Pending(spec, span)
        self._wake.set()
        return position

    def prepare_adapter(self, request: scheduler_pb2.PrepareAdapterRequest, metadata) -> str:
        """A gateway's hint that a request for this adapter follows: the worker placement would choose starts
        fetching it now (`scheduler/hints.py`), in the request's trace. Returns that worker's id, or "" when
        none was told."""
        check_hint(request)
        adapter = (request.adapter, request.adapter_version)
        decision = self.hints.hint(self.policy, adapter, request.adapter_rank, request.tenant, time.time())
        if decision is None:
            return ""
        context = telemetry.context_from(metadata)
        with telemetry.tracer().start_as_current_span("scheduler.adapter_hint", context=context) as span:
            span.set_attribute("loraserve.adapter", f"{request.adapter}@{request.adapter_version}")
            span.set_attribute("loraserve.worker_id", decision.worker_id)
            decision = replace(decision, trace=tuple(telemetry.carrier().items()))
        if not self._prefetch(decision):
            return ""
        metrics.ADAPTER_HINTS.inc()
        return decision.worker_id

    def cancel(self, request_id: str, reason: str) -> bool:
        found, decisions = self.policy.cancel(request_id, reason)
        pending = self.pending.pop(request_id, None)
        if pending is not None:
            pending.span.set_attribute("loraserve.cancelled", reason)
            pending.span.end()
        self._execute(decisions)
        return found

    # ---- the loop ------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event | threading.Event | None = None) -> None:
        """Receive and schedule until `stop` is set (or cancelled); raises RoleFailed if either task dies."""
        try:
            tasks = {
                "receive worker messages": self.inbox.run(),
                "scheduling rounds": self._rounds(),
                "watch worker connections": self._disconnects.run(self._probes.disconnected),
                "probe workers after disconnects": self._probes.run(),
            }
            await run_tasks(tasks, stop)
        finally:
            self.close()

    async def _rounds(self) -> None:
        while True:
            self._run_round()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.tick_s):
                    await self._wake.wait()

    def _turn_ended(self) -> float:
        """A turn of worker messages was read: the round runs on them next. How long the last round took."""
        self._wake.set()
        return self._round_s

    def _on_report(self, report: WorkerReport) -> None:
        known = report.worker_id in self.policy.workers
        self._execute(self.policy.on_report(report, time.time()))
        if not known and report.worker_id in self.policy.workers:
            log.info("worker %s registered (ready=%s, %d pages)", report.worker_id, report.ready, report.total_pages)

    def _on_heartbeat(self, heartbeat: Heartbeat) -> None:
        """Keep the worker alive; a step that has run past the worker timeout is logged (it would have been
        taken for a dead worker before heartbeats), and placement avoids it until it reports."""
        if not self.policy.on_heartbeat(heartbeat, time.time()):
            return
        if heartbeat.step_s >= self.policy.cluster.config.worker_timeout_s:
            self._dropped.warning(
                heartbeat.worker_id,
                "slow step",
                "a step of %.1f s so far; kept (it heartbeats), nothing new placed",
                heartbeat.step_s,
            )

    def _run_round(self) -> None:
        started, now = time.perf_counter(), time.time()
        if stalled := self.policy.cluster.listening(now, STALL_S):
            log.warning("the scheduler's loop did not run for %.1f s: worker silence then not counted", stalled)
        self._execute(self.policy.schedule(now))
        self._round_s = time.perf_counter() - started
        metrics.QUEUE_LENGTH.set(len(self.policy.queue))
        metrics.READY_WORKERS.set(len(self.policy.ready_workers()))

    def _execute(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            self._decide(decision)

    def _assign(self, decision: AssignTo) -> None:
        request = decision.request
        pending = self.pending.get(request.request_id)
        if pending is None:  # it failed earlier in this round (its worker was dropped)
            return
        now = time.time()
        with telemetry.tracer().start_as_current_span(
            "scheduler.place", context=trace.set_span_in_context(pending.span)
        ) as span:
            span.set_attribute("loraserve.worker_id", decision.worker_id)
            assign = Assign(pending.spec, queued_s=now - request.enqueued, trace=telemetry.carrier())
        if self._to_worker(decision.worker_id, assign, request.request_id):
            del self.pending[request.request_id]
            pending.span.set_attribute("loraserve.worker_id", decision.worker_id)
            pending.span.end()  # the queue span: a bounced ASSIGN queues the request again
            metrics.ASSIGNED.inc()

    def _to_worker(self, worker_id: str, message, bounced_request: str | None = None) -> bool:
        """Send to a worker; if it is gone, drop it at once (its requests fail; `bounced_request`,
        which never reached it, is queued again) and return False."""
        try:
            sent_or_raise(send(self.workers, message, to=worker_id.encode()))
            return True
        except zmq.ZMQError as e:  # ROUTER_MANDATORY: no such peer any more
            log.warning("cannot reach worker %s: %s", worker_id, e)
            self._execute(self.policy.unreachable(worker_id, bounced_request))
            self._wake.set()
            return False

    def _prefetch(self, decision: PrefetchOn) -> bool:
        adapters, scores = [list(k) for k in decision.adapters], list(decision.scores)
        if self._to_worker(decision.worker_id, Prefetch(adapters, scores, dict(decision.trace))):
            metrics.PREFETCH_HINTS.inc(len(decision.adapters))
            return True
        return False

    def _migrate(self, decision: Migrate) -> None:
        """Its gateway submits it again (retry), then its worker drops it: the new attempt has its own id."""
        metrics.MIGRATED.inc()
        self._fail(decision.request, "UNAVAILABLE", decision.reason, retry=True, count=False, moved=True)
        self._to_worker(decision.worker_id, Cancel([decision.request.request_id], decision.reason))

    def _fail(
        self,
        request: QueuedRequest,
        status: str,
        message: str,
        retry: bool = False,
        count: bool = True,
        moved: bool = False,
    ) -> None:
        if count:
            metrics.FAILED.labels(status).inc()
        pending = self.pending.pop(request.request_id, None)
        if pending is not None:
            pending.span.set_attribute("loraserve.failed", status)
            pending.span.end()
        self.policy.forget(request.request_id)
        try:
            failure = Tokens(
                request.request_id, [], finished=True, error_status=status, error=message, retry=retry, moved=moved
            )
            send(self.gateways.get(request.reply_to), failure, flags=zmq.NOBLOCK)
        except (zmq.ZMQError, BadEndpointError) as e:  # zmq.Again: the gateway is not taking messages
            self._dropped.warning(
                request.reply_to, "failure", "could not tell the gateway that %s failed: %s", request.request_id, e
            )

    def close(self) -> None:
        self._disconnects.close()
        self.workers.close(linger=0)
        self.gateways.close(linger_ms=0)
        self._stop_auth()
        self.ctx.term()

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
