"""The scheduler process's I/O: gRPC for gateways, ZMQ for workers, around the pure policy.

All state changes happen on one asyncio loop: a gRPC call or a worker message updates the
policy, then `_run_round` executes the policy's decisions (send ASSIGN / CANCEL / PREFETCH to
workers, tell gateways about failures). A timer runs a round every `tick_s` even when nothing
arrives, so dead workers and expired deadlines are noticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass

import zmq
import zmq.asyncio
from opentelemetry import trace

from loraserve import telemetry
from loraserve.convert import sampling_from_pb
from loraserve.errors import InvalidRequestError
from loraserve.scheduler import metrics
from loraserve.scheduler.policy import (
    AssignTo,
    CancelOn,
    Decision,
    Fail,
    PrefetchOn,
    QueuedRequest,
    SchedulerPolicy,
    WorkerGone,
)
from loraserve.sockets import make_socket, send
from loraserve.v1 import scheduler_pb2
from loraserve.wire import Assign, Cancel, Prefetch, Tokens, WireError, WorkerReport, decode

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """What the loop keeps per queued request besides the policy's view."""

    submit: scheduler_pb2.SubmitRequest
    span: trace.Span  # "scheduler.queue", ended at placement


class SchedulerLoop:
    def __init__(self, policy: SchedulerPolicy, worker_address: str, tick_s: float = 0.05):
        self.policy = policy
        self.ctx = zmq.asyncio.Context()
        self.workers = make_socket(self.ctx, zmq.ROUTER, bind=worker_address)
        self.gateways: dict[str, zmq.asyncio.Socket] = {}
        self.pending: dict[str, _Pending] = {}
        self.tick_s = tick_s
        self._wake = asyncio.Event()

    # ---- gRPC entry points (called by service.py) ----------------------------------------------
    def submit(self, request: scheduler_pb2.SubmitRequest, metadata) -> int:
        if not request.request_id or request.request_id in self.pending or request.request_id in self.policy.placed:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is empty or already in use")
        now = time.time()
        queued = QueuedRequest(
            request_id=request.request_id,
            adapter=(request.adapter, request.adapter_version) if request.adapter else None,
            prompt_len=len(request.prompt_ids),
            max_new_tokens=request.max_new_tokens,
            reply_to=request.reply_to,
            arrival=request.arrival_unix or now,
            deadline=request.deadline_unix or None,
        )
        span = telemetry.tracer().start_span("scheduler.queue", context=telemetry.context_from(metadata))
        span.set_attribute("loraserve.request_id", request.request_id)
        try:
            position = self.policy.add(queued, now)
        except Exception as e:
            span.record_exception(e)
            span.end()
            raise
        span.set_attribute("loraserve.queue_position", position)
        self.pending[request.request_id] = _Pending(request, span)
        self._wake.set()
        return position

    def cancel(self, request_id: str, reason: str) -> bool:
        found, decisions = self.policy.cancel(request_id, reason)
        pending = self.pending.pop(request_id, None)
        if pending is not None:
            pending.span.set_attribute("loraserve.cancelled", reason)
            pending.span.end()
        self._execute(decisions)
        return found

    # ---- the loop ------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        receiver = asyncio.create_task(self._receive())
        try:
            while not stop.is_set():
                self._run_round()
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.tick_s)
        finally:
            receiver.cancel()
            self.close()

    async def _receive(self) -> None:
        while True:
            frames = await self.workers.recv_multipart()
            identity, body = frames[0], frames[1:]
            try:
                message = decode(body)
            except WireError as e:
                log.warning("dropping a malformed message from %r: %s", identity, e)
                continue
            if not isinstance(message, WorkerReport) or message.worker_id.encode() != identity:
                log.warning("dropping unexpected %s from %r", type(message).__name__, identity)
                continue
            known = message.worker_id in self.policy.workers
            self._execute(self.policy.on_report(message, time.time()))
            if not known:
                log.info(
                    "worker %s registered (ready=%s, %d pages)",
                    message.worker_id,
                    message.ready,
                    message.total_pages,
                )
            self._wake.set()

    def _run_round(self) -> None:
        self._execute(self.policy.schedule(time.time()))
        metrics.QUEUE_LENGTH.set(len(self.policy.queue))
        metrics.READY_WORKERS.set(len(self.policy.ready_workers()))

    def _execute(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            if isinstance(decision, AssignTo):
                self._assign(decision)
            elif isinstance(decision, CancelOn):
                self._to_worker(decision.worker_id, Cancel(list(decision.request_ids), decision.reason))
            elif isinstance(decision, PrefetchOn):
                self._to_worker(decision.worker_id, Prefetch([list(k) for k in decision.adapters]))
            elif isinstance(decision, Fail):
                self._fail(decision.request, decision.status, decision.message)
            elif isinstance(decision, WorkerGone):
                log.warning("%s", decision.reason)

    def _assign(self, decision: AssignTo) -> None:
        request = decision.request
        pending = self.pending.pop(request.request_id)
        now = time.time()
        pending.span.set_attribute("loraserve.worker_id", decision.worker_id)
        pending.span.end()
        with telemetry.tracer().start_as_current_span(
            "scheduler.place", context=trace.set_span_in_context(pending.span)
        ) as span:
            span.set_attribute("loraserve.worker_id", decision.worker_id)
            submit = pending.submit
            assign = Assign(
                request_id=request.request_id,
                prompt_ids=list(submit.prompt_ids),
                adapter=submit.adapter or None,
                adapter_version=submit.adapter_version,
                sampling=asdict(sampling_from_pb(submit.sampling, submit.max_new_tokens, list(submit.stop_token_ids))),
                reply_to=submit.reply_to,
                arrival=request.arrival,
                deadline=request.deadline,
                queued_s=now - request.enqueued,
                trace=telemetry.carrier(),
            )
        if not self._to_worker(decision.worker_id, assign):
            self._fail(request, "UNAVAILABLE", f"worker {decision.worker_id} is unreachable; retry the request")
        else:
            metrics.ASSIGNED.inc()

    def _to_worker(self, worker_id: str, message) -> bool:
        try:
            send(self.workers, message, to=worker_id.encode())
            return True
        except zmq.ZMQError as e:  # ROUTER_MANDATORY: the worker is gone
            log.warning("cannot reach worker %s: %s", worker_id, e)
            return False

    def _fail(self, request: QueuedRequest, status: str, message: str) -> None:
        metrics.FAILED.labels(status).inc()
        pending = self.pending.pop(request.request_id, None)
        if pending is not None:
            pending.span.set_attribute("loraserve.failed", status)
            pending.span.end()
        self.policy.placed.pop(request.request_id, None)
        sock = self.gateways.get(request.reply_to)
        if sock is None:
            sock = self.gateways[request.reply_to] = make_socket(self.ctx, zmq.PUSH, connect=request.reply_to)
        try:
            failure = Tokens(request.request_id, [], finished=True, error_status=status, error=message)
            send(sock, failure, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning(
                "gateway %s is not taking messages; dropped the failure of %s",
                request.reply_to,
                request.request_id,
            )

    def cluster_state(self) -> scheduler_pb2.ClusterState:
        now = time.time()
        workers = []
        for view in self.policy.workers.values():
            r = view.report
            workers.append(
                scheduler_pb2.WorkerState(
                    worker_id=r.worker_id,
                    ready=r.ready,
                    running=len(r.running),
                    waiting=len(r.waiting),
                    max_batch_size=r.max_batch_size,
                    free_pages=r.free_pages,
                    total_pages=r.total_pages,
                    kv_pages=r.kv_pages,
                    adapter_pages=r.adapter_pages,
                    resident_adapters=[f"{n}@{v}" for n, v in r.resident],
                    last_report_age_s=now - view.last_report,
                    prefetch_hits=r.prefetch_hits,
                    prefetch_misses=r.prefetch_misses,
                    steps=r.steps,
                    pool_waste_fraction=r.waste_fraction,
                )
            )
        return scheduler_pb2.ClusterState(
            workers=workers,
            queue_length=len(self.policy.queue),
            max_queue_length=self.policy.config.max_queue_length,
        )

    def close(self) -> None:
        for sock in [self.workers, *self.gateways.values()]:
            sock.close(linger=0)
        self.ctx.term()
