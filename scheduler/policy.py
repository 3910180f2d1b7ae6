"""The scheduler's policy: a pure object (no sockets, no clocks of its own) driven by `loop.py`.

    policy.add(request, now)            admit to the bounded FCFS queue (or refuse)
    policy.cancel(request_id)           -> decisions
    policy.on_report(report, now)       a worker's state after a step (or a heartbeat)
    policy.schedule(now)                -> decisions: assignments, prefetch hints, failures

Placement follows Punica §5.1: the request at the head of the queue goes to the *busiest* ready
worker that still has batch room and pool room for the request's whole KV (prompt + max new
tokens) — consolidating load so that lightly loaded workers drain. Between reports the policy
counts its own assignments against a worker's room, so a burst is not piled onto one worker.

Prediction (S-LoRA §5.2): the adapters of the next queued requests are what workers will need
next; each worker that lacks one of them is told to prefetch it, while it is still decoding.

Failure: a worker that stops reporting for `worker_timeout_s` is dropped, and every request it
held fails with UNAVAILABLE marked `retry` (the gateway fails it over to another worker with the
tokens already streamed); so is one the loop could not deliver a message to (`unreachable`: the
loop probes every worker when its socket monitor sees a disconnect), at once, and the request
whose ASSIGN bounced goes back to the head of the queue (it never started). Placement skips a
worker whose last report is older than `stale_after_s`, before it is declared dead, and one that
is draining. A report from a new process under a known worker id (its `instance` changed) drops
the old one the same way before registering the new one.

A dropped worker that reports again under the same instance (it was stopped, then resumed) is a
zombie: its requests were failed over already, so it is told to cancel everything it holds and is
registered again only once its reports show it empty. A worker this scheduler never dropped is
registered as it is, requests included (*adopted*): after a scheduler restart, streams in flight
go on, and cancels still reach them.

Queued requests whose deadline passed fail with DEADLINE_EXCEEDED; when no worker is left,
queued requests fail with UNAVAILABLE after `worker_timeout_s`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from loraserve.errors import InvalidConfigError, ResourceExhaustedError, UnavailableError
from loraserve.wire import AdapterKey, WorkerReport


@dataclass(frozen=True)
class PolicyConfig:
    max_queue_length: int = 1024
    worker_timeout_s: float = 1.5  # a worker silent this long is dead (workers report every 0.25 s)
    prefetch_depth: int = 16  # queued requests looked at when predicting adapters
    stale_after_s: float = 0.75  # no new placement on a worker silent this long (at most worker_timeout_s)
    max_zombies: int = 1024  # dropped workers remembered, to recognise one that comes back

    def __post_init__(self) -> None:
        if self.max_queue_length < 1 or self.worker_timeout_s <= 0 or self.prefetch_depth < 0:
            raise InvalidConfigError(f"invalid scheduler policy config {self}")
        if self.stale_after_s <= 0 or self.max_zombies < 0:
            raise InvalidConfigError(f"invalid scheduler policy config {self}")


@dataclass
class QueuedRequest:
    request_id: str
    adapter: AdapterKey | None
    prompt_len: int
    max_new_tokens: int
    reply_to: str
    arrival: float
    deadline: float | None = None
    enqueued: float = 0.0
    payload: Any = None  # what the loop needs to build the assignment; opaque here


@dataclass
class WorkerView:
    worker_id: str
    last_report: float
    report: WorkerReport
    assigned: set[str] = field(default_factory=set)  # request ids held by this worker

    @property
    def resident(self) -> set[AdapterKey]:
        return {(name, int(version)) for name, version in self.report.resident}


# ---- decisions --------------------------------------------------------------------------------
@dataclass(frozen=True)
class AssignTo:
    worker_id: str
    request: QueuedRequest


@dataclass(frozen=True)
class CancelOn:
    worker_id: str
    request_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class PrefetchOn:
    worker_id: str
    adapters: tuple[AdapterKey, ...]


@dataclass(frozen=True)
class Fail:
    request: QueuedRequest
    status: str  # grpc.StatusCode name
    message: str
    retry: bool = False  # its worker was lost: the gateway may resubmit it elsewhere


@dataclass(frozen=True)
class WorkerGone:
    worker_id: str
    reason: str


Decision = AssignTo | CancelOn | PrefetchOn | Fail | WorkerGone


class SchedulerPolicy:
    """Admission, placement, prediction and failure handling over plain data (see the module docstring).

    Owns the waiting queue, the view of every worker (last report, assignments not yet reported),
    which worker holds which request, and the dropped workers it still recognises.
    """

    def __init__(self, config: PolicyConfig | None = None):
        self.config = config or PolicyConfig()
        self.queue: OrderedDict[str, QueuedRequest] = OrderedDict()
        self.workers: dict[str, WorkerView] = {}
        # request id -> (worker, request); the request is None when adopted (placed by an earlier scheduler)
        self.placed: dict[str, tuple[str, QueuedRequest | None]] = {}
        self._zombies: OrderedDict[str, str] = OrderedDict()  # dropped worker id -> its instance then
        self._prefetch_sent: dict[str, tuple[AdapterKey, ...]] = {}
        self._no_worker_since: float | None = None

    # ---- inputs --------------------------------------------------------------------------------
    def ready_workers(self) -> list[WorkerView]:
        """Workers that take new requests: warmed up and not draining."""
        return [w for w in self.workers.values() if w.report.ready and not w.report.draining]

    def add(self, request: QueuedRequest, now: float, resumed: bool = False) -> int:
        """Queue a request; returns how many are ahead of it.

        A `resumed` request (failed over from a lost worker, tokens already streamed) was admitted
        before: it goes to the head of the queue, and a full queue does not refuse it.
        """
        if not self.ready_workers():
            raise UnavailableError("no worker is ready to serve requests; try again shortly")
        if len(self.queue) >= self.config.max_queue_length and not resumed:
            raise ResourceExhaustedError(
                f"the scheduler queue is full ({self.config.max_queue_length} requests waiting); retry later"
            )
        if not any(self._fits_ever(w, request) for w in self.ready_workers()):
            raise ResourceExhaustedError(
                f"no worker's pool can ever hold this request ({request.prompt_len} prompt + "
                f"{request.max_new_tokens} new tokens); lower max_new_tokens"
            )
        request.enqueued = now
        self.queue[request.request_id] = request
        if resumed:
            self.queue.move_to_end(request.request_id, last=False)
            return 0
        return len(self.queue) - 1

    def cancel(self, request_id: str, reason: str) -> tuple[bool, list[Decision]]:
        """Remove a request from the queue, or tell its worker to stop it. Returns (found, decisions)."""
        if self.queue.pop(request_id, None) is not None:
            return True, []
        placed = self.placed.get(request_id)
        if placed is None:
            return False, []
        return True, [CancelOn(placed[0], (request_id,), reason)]

    def forget(self, request_id: str) -> None:
        """A placed request ended outside the policy (its ASSIGN could not be sent): drop it from
        `placed` and from its worker's assignments together, so neither keeps a dangling id."""
        placed = self.placed.pop(request_id, None)
        if placed is not None and placed[0] in self.workers:
            self.workers[placed[0]].assigned.discard(request_id)

    def on_report(self, report: WorkerReport, now: float) -> list[Decision]:
        view = self.workers.get(report.worker_id)
        decisions: list[Decision] = []
        if view is not None and report.instance != view.report.instance:
            decisions += self._drop(view, f"worker {report.worker_id} restarted")
            view = None
        if view is None:
            if self._zombies.get(report.worker_id) == report.instance:  # back from the dead
                held = (*report.running, *report.waiting)
                if held:  # what it holds was failed over already
                    return [*decisions, CancelOn(report.worker_id, held, "this worker was dropped")]
                if report.fatal:
                    return decisions
            self._zombies.pop(report.worker_id, None)
            view = self.workers[report.worker_id] = WorkerView(report.worker_id, now, report)
            for request_id in (*report.running, *report.waiting):  # adopted (this scheduler restarted)
                if request_id not in self.placed:
                    view.assigned.add(request_id)
                    self.placed[request_id] = (report.worker_id, None)
        view.report, view.last_report = report, now
        for request_id in report.finished:
            view.assigned.discard(request_id)
            self.placed.pop(request_id, None)
        if report.fatal:  # its last report: it crashed, or drained and stops
            how = "stopped" if report.draining else "failed"
            decisions += self._drop(view, f"worker {report.worker_id} {how}: {report.fatal}")
        return decisions

    def unreachable(self, worker_id: str, request_id: str | None = None) -> list[Decision]:
        """A message to `worker_id` could not be delivered: the worker is gone. Drop it (what it held
        fails) and put `request_id`, whose ASSIGN bounced, back at the head of the queue."""
        placed = self.placed.pop(request_id, None) if request_id else None
        view = self.workers.get(worker_id)
        if view is not None and request_id:
            view.assigned.discard(request_id)
        if placed is not None and placed[1] is not None:
            self.queue[request_id] = placed[1]
            self.queue.move_to_end(request_id, last=False)
        return self._drop(view, f"worker {worker_id} is unreachable") if view is not None else []

    # ---- the scheduling round ------------------------------------------------------------------
    def schedule(self, now: float) -> list[Decision]:
        decisions: list[Decision] = []
        for view in list(self.workers.values()):
            if now - view.last_report > self.config.worker_timeout_s:
                decisions += self._drop(view, f"worker {view.worker_id} stopped responding")
        decisions += self._expire(now)
        decisions += self._place(now)
        decisions += self._predict()
        return decisions

    def _drop(self, view: WorkerView, reason: str) -> list[Decision]:
        del self.workers[view.worker_id]
        self._prefetch_sent.pop(view.worker_id, None)
        self._zombies[view.worker_id] = view.report.instance
        while len(self._zombies) > self.config.max_zombies:
            self._zombies.popitem(last=False)
        decisions: list[Decision] = [WorkerGone(view.worker_id, reason)]
        for request_id in sorted(view.assigned):
            placed = self.placed.pop(request_id, None)
            if placed is not None and placed[1] is not None:  # adopted ones: their gateway watches the cluster
                decisions.append(Fail(placed[1], "UNAVAILABLE", f"{reason}; the request was lost", retry=True))
        return decisions

    def _expire(self, now: float) -> list[Decision]:
        decisions: list[Decision] = []
        for request in list(self.queue.values()):
            if request.deadline is not None and now >= request.deadline:
                del self.queue[request.request_id]
                decisions.append(Fail(request, "DEADLINE_EXCEEDED", "the deadline passed while the request was queued"))
        if self.ready_workers():
            self._no_worker_since = None
        elif self.queue:
            self._no_worker_since = self._no_worker_since or now
            if now - self._no_worker_since >= self.config.worker_timeout_s:
                for request in list(self.queue.values()):
                    decisions.append(Fail(request, "UNAVAILABLE", "no worker is available to serve the request"))
                self.queue.clear()
        return decisions

    def _place(self, now: float) -> list[Decision]:
        decisions: list[Decision] = []
        while self.queue:
            request = next(iter(self.queue.values()))
            worker = self._choose(request, now)
            if worker is None:
                break  # first come, first served: the head waits, nobody overtakes it
            del self.queue[request.request_id]
            worker.assigned.add(request.request_id)
            self.placed[request.request_id] = (worker.worker_id, request)
            decisions.append(AssignTo(worker.worker_id, request))
        return decisions

    def _load(self, view: WorkerView) -> int:
        """Requests the worker holds: reported running/waiting plus assignments not yet reported."""
        reported = set(view.report.running) | set(view.report.waiting)
        return len(reported | view.assigned)

    def _room_pages(self, view: WorkerView) -> int:
        """Pool pages still free for KV, counting what unreported assignments will take."""
        report = view.report
        unreported = view.assigned - set(report.running) - set(report.waiting)
        requests = (self.placed[r][1] for r in unreported if r in self.placed)
        reserved = sum(self._kv_pages(view, r) for r in requests if r is not None)
        return report.free_pages + report.evictable_pages - reserved

    @staticmethod
    def _kv_pages(view: WorkerView, request: QueuedRequest) -> int:
        tokens = request.prompt_len + request.max_new_tokens
        return -(-tokens // max(1, view.report.tokens_per_page))

    def _fits_ever(self, view: WorkerView, request: QueuedRequest) -> bool:
        return self._kv_pages(view, request) <= view.report.total_pages

    def _choose(self, request: QueuedRequest, now: float) -> WorkerView | None:
        candidates = [
            w
            for w in self.ready_workers()
            if now - w.last_report <= min(self.config.stale_after_s, self.config.worker_timeout_s)
            and self._load(w) < w.report.max_batch_size
            and self._kv_pages(w, request) <= self._room_pages(w)
        ]
        if not candidates:
            return None
        return max(
            candidates,
            key=lambda w: (
                self._load(w),
                request.adapter in w.resident if request.adapter else False,
                w.worker_id,
            ),
        )

    def _predict(self) -> list[Decision]:
        wanted: list[AdapterKey] = []
        for request in list(self.queue.values())[: self.config.prefetch_depth]:
            if request.adapter is not None and request.adapter not in wanted:
                wanted.append(request.adapter)
        decisions: list[Decision] = []
        for view in self.ready_workers():
            missing = tuple(k for k in wanted if k not in view.resident)
            if missing and missing != self._prefetch_sent.get(view.worker_id):
                decisions.append(PrefetchOn(view.worker_id, missing))
            self._prefetch_sent[view.worker_id] = missing
        return decisions
