"""The scheduler's policy: a pure object (no sockets, no clocks of its own) driven by `loop.py`.

    policy.add(request, now)            admit to the bounded queue (or refuse)
    policy.cancel(request_id)           -> decisions
    policy.on_report(report, now)       a worker's state after a step (or a heartbeat)
    policy.schedule(now)                -> decisions: assignments, prefetch hints, failures

It composes two parts: the cluster view (`cluster.py`: workers, their reports, which worker holds which
request, failures and adoption) and one strategy, which owns the queue and decides the order,
placement and prediction: `FcfsStrategy` (`fcfs.py`, the baseline) or `AdaptiveStrategy`
(`adaptive_strategy.py`, the default). `PolicyConfig.policy` (`--policy`) picks which is built;
nothing else asks which it is. What is the same under both lives here:

Placement, round by round: the next candidate of the strategy's queue goes to the worker the
strategy chooses; a request of a prefill group (`QueuedRequest.group`: the n choices of one prompt)
goes to the worker its group's last request went to while that worker has room, whatever else
placement would choose: there the prompt is computed once. Between reports the cluster view counts
the policy's own assignments against a worker's room, so a burst is not piled onto one worker.

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
queued requests fail with UNAVAILABLE and `retry` after `worker_timeout_s` (their gateways wait
for a worker, within a bound, and submit them again).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from loraserve.errors import ResourceExhaustedError, UnavailableError
from loraserve.scheduler.adaptive_strategy import AdaptiveStrategy
from loraserve.scheduler.cluster import ClusterView, WorkerView
from loraserve.scheduler.config import POLICIES, PolicyConfig
from loraserve.scheduler.decisions import (
    AssignTo,
    CancelOn,
    Decision,
    Fail,
    Migrate,
    PrefetchOn,
    QueuedRequest,
    WorkerGone,
)
from loraserve.scheduler.fcfs import FcfsStrategy
from loraserve.wire import WorkerReport

__all__ = [
    "POLICIES",
    "AssignTo",
    "CancelOn",
    "Decision",
    "Fail",
    "Migrate",
    "PolicyConfig",
    "PrefetchOn",
    "QueuedRequest",
    "SchedulerPolicy",
    "WorkerGone",
]

MAX_GROUPS = 4096  # prefill groups whose worker placement remembers (the most recent)
MAX_PASSED = 64  # requests a round may pass over (they could not be placed) before it stops
Strategy = FcfsStrategy | AdaptiveStrategy


class SchedulerPolicy:
    """Admission, placement, prediction and failure handling over plain data (see the module docstring).

    Owns the cluster view, the strategy (and through it the queue), the deadlines of queued requests
    and the worker each prefill group went to last.
    """

    def __init__(self, config: PolicyConfig | None = None):
        self.config = config or PolicyConfig()
        self.cluster = ClusterView(self.config.cluster)
        self.strategy: Strategy = (
            AdaptiveStrategy(self.config.adaptive, self.cluster)
            if self.config.policy == "adaptive"
            else FcfsStrategy(self.config.fcfs, self.cluster)
        )
        self.cluster.on_change = self.strategy.worker_changed
        self.queue = self.strategy.queue
        self.workers = self.cluster.workers  # worker id -> its view
        self.placed = self.cluster.placed  # request id -> (worker id, request; None when adopted)
        self._deadlines: list[tuple[float, str]] = []  # (deadline, request id) of queued requests: a heap
        self._group_workers: OrderedDict[str, str] = OrderedDict()  # prefill group -> its last worker
        self._no_worker_since: float | None = None

    @property
    def max_queue_length(self) -> int:
        return self.strategy.config.max_queue_length

    def ready_workers(self) -> list[WorkerView]:
        """Workers that take new requests: warmed up and not draining."""
        return self.cluster.ready()

    # ---- inputs --------------------------------------------------------------------------------
    def add(self, request: QueuedRequest, now: float, resumed: bool = False) -> int:
        """Queue a request; returns about how many are ahead of it.

        A `resumed` request (failed over from a lost worker, tokens already streamed) was admitted
        before: it goes to the head of the queue, and a full queue does not refuse it. The strategy
        may refuse a new one (adaptive: it cannot meet its TTFT target or deadline, or its tenant
        floods a nearly full queue).
        """
        if not self.cluster.ready():
            raise UnavailableError("no worker is ready to serve requests; try again shortly")
        limit = self.max_queue_length
        if len(self.queue) >= limit and not resumed:
            raise ResourceExhaustedError(f"the scheduler queue is full ({limit} requests waiting); retry later")
        if not self.cluster.fits_ever(request):
            raise ResourceExhaustedError(
                f"no worker's pool can ever hold this request ({request.prompt_len} prompt + "
                f"{request.max_new_tokens} new tokens); lower max_new_tokens"
            )
        request.enqueued = now
        if resumed:
            self.queue.push(request, front=True)
            ahead = 0
        else:
            ahead = self.strategy.admit(request, now)
        if request.deadline is not None:  # `_expire` looks only at these
            heapq.heappush(self._deadlines, (request.deadline, request.request_id))
        return ahead

    def cancel(self, request_id: str, reason: str) -> tuple[bool, list[Decision]]:
        """Remove a request from the queue, or tell its worker to stop it. Returns (found, decisions)."""
        if self.queue.remove(request_id) is not None:
            return True, []
        placed = self.placed.get(request_id)
        if placed is None:
            return False, []
        return True, [CancelOn(placed[0], (request_id,), reason)]

    def forget(self, request_id: str) -> None:
        """A placed request ended outside the policy (its ASSIGN could not be sent): drop it from
        `placed` and from its worker's assignments together, so neither keeps a dangling id."""
        self.cluster.unplace(request_id)

    def on_report(self, report: WorkerReport, now: float) -> list[Decision]:
        view, decisions, finished = self.cluster.on_report(report, now)
        if view is None:
            return decisions
        self.strategy.observe(view, finished, now)
        if report.fatal:  # its last report: it crashed, or drained and stops
            how = "stopped" if report.draining else "failed"
            decisions += self.cluster.drop(view, f"worker {report.worker_id} {how}: {report.fatal}")
        return decisions

    def unreachable(self, worker_id: str, request_id: str | None = None) -> list[Decision]:
        """A message to `worker_id` could not be delivered: the worker is gone. Drop it (what it held
        fails) and put `request_id`, whose ASSIGN bounced, back at the head of the queue."""
        placed = self.cluster.unplace(request_id) if request_id else None
        if placed is not None and placed[1] is not None:
            self.queue.push(placed[1], front=True)
            if placed[1].deadline is not None:
                heapq.heappush(self._deadlines, (placed[1].deadline, placed[1].request_id))
        view = self.workers.get(worker_id)
        return self.cluster.drop(view, f"worker {worker_id} is unreachable") if view is not None else []

    def hint_target(self, request: QueuedRequest, now: float) -> str | None:
        """The worker a request like `request` would be placed on now, if it does not hold its adapter (and
        the strategy does not count it as loading it); from then on it counts as loading it, so placement
        follows the hint. For the gateway's early hints (`scheduler/hints.py`), before the request comes."""
        worker = self._choose(request, now) if request.adapter is not None else None
        if worker is None or request.adapter in worker.resident:
            return None
        assert request.adapter is not None
        return worker.worker_id if self.strategy.hinted(worker, request.adapter, now) else None

    # ---- the scheduling round ------------------------------------------------------------------
    def schedule(self, now: float) -> list[Decision]:
        decisions = self.cluster.silent(now)
        decisions += self._expire(now)
        placed, held = self._place(now)
        decisions += placed
        decisions += self.strategy.plan(now, held)
        return decisions

    def _expire(self, now: float) -> list[Decision]:
        decisions: list[Decision] = []
        while self._deadlines and self._deadlines[0][0] <= now:  # only queued requests with a deadline
            _, request_id = heapq.heappop(self._deadlines)
            request = self.queue.remove(request_id)
            if request is not None:
                decisions.append(Fail(request, "DEADLINE_EXCEEDED", "the deadline passed while the request was queued"))
        if self.cluster.ready():
            self._no_worker_since = None
        elif self.queue:
            self._no_worker_since = self._no_worker_since or now
            if now - self._no_worker_since >= self.cluster.config.worker_timeout_s:
                for request in self.queue.values():
                    message = "no worker is available to serve the request"
                    decisions.append(Fail(request, "UNAVAILABLE", message, retry=True))  # its gateway waits for one
                self.queue.clear()
        return decisions

    def _place(self, now: float) -> tuple[list[Decision], bool]:
        """Place what the strategy's queue offers until it offers nothing more; returns the assignments,
        and whether a request was held for its adapter's prefetch (the hint must go out this round)."""
        decisions: list[Decision] = []
        if not self.queue:
            return decisions, False
        held = False
        passed: set[str] = set()  # could not be placed this round (adaptive: others may overtake them)
        cap = self.strategy.tenant_cap(now)
        in_flight = self.cluster.in_flight
        capped = {cap[0]} if cap is not None and in_flight[cap[0]] >= cap[1] else set()
        while len(passed) < MAX_PASSED and (request := self.queue.next_candidate(now, passed, capped)) is not None:
            worker = self._choose(request, now)
            if worker is not None and self.strategy.hold(request, worker, now):
                passed.add(request.request_id)
                held = True
                continue
            if worker is None:
                passed.add(request.request_id)
                if not any(w.held < w.report.max_batch_size for w in self.cluster.fresh(now)):
                    break  # no batch room anywhere: nobody can be placed
                continue
            self.queue.remove(request.request_id)
            self.cluster.place(worker, request, now)
            self.strategy.assigned(worker, request, now)
            if request.group is not None:
                self._remember_group(request.group, worker.worker_id)
            decisions.append(AssignTo(worker.worker_id, request))
            if cap is not None and request.tenant == cap[0] and in_flight[request.tenant] >= cap[1]:
                capped.add(request.tenant)
        return decisions, held

    def _choose(self, request: QueuedRequest, now: float) -> WorkerView | None:
        beside = self._beside_group(request, now)
        return beside if beside is not None else self.strategy.choose(request, now)

    def _beside_group(self, request: QueuedRequest, now: float) -> WorkerView | None:
        """The worker the request's prefill group went to, when it is fresh and has room for the request:
        there the prompt is computed once (shared prefill), whatever the strategy would choose."""
        worker_id = self._group_workers.get(request.group) if request.group is not None else None
        view = self.workers.get(worker_id) if worker_id is not None else None
        if view is None or not self.cluster.is_fresh(view, now):
            return None
        return view if self.strategy.fits(view, request, now) else None

    def _remember_group(self, group: str, worker_id: str) -> None:
        self._group_workers[group] = worker_id
        self._group_workers.move_to_end(group)
        while len(self._group_workers) > MAX_GROUPS:
            self._group_workers.popitem(last=False)
