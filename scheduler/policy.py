"""The scheduler's policy: a pure object (no sockets, no clocks of its own) driven by `loop.py`.

    policy.add(request, now)            admit to the bounded queue (or refuse)
    policy.cancel(request_id)           -> decisions
    policy.on_report(report, now)       a worker's state after a step (or when idle)
    policy.on_heartbeat(heartbeat, now) a worker is alive (sent by its I/O thread, whatever its step does)
    policy.schedule(now)                -> decisions: assignments, prefetch hints, failures

It composes two parts: the cluster view (`cluster.py`: workers, their reports, which worker holds which
request, failures and adoption) and one strategy, which owns the queue and decides the order,
placement and prediction: `FcfsStrategy` (`fcfs.py`, the baseline) or `AdaptiveStrategy`
(`adaptive/strategy.py`, the default). `PolicyConfig.policy` (`--policy`) picks which is built;
nothing else asks which it is. What is the same under both lives here:

Placement, round by round: the next candidate of the strategy's queue goes to the worker the
strategy chooses; a request of a prefill group (`QueuedRequest.group`: the n choices of one prompt)
goes to the worker its group's last request went to while that worker has room, whatever else
placement would choose: there the prompt is computed once. Between reports the cluster view counts
the policy's own assignments against a worker's room, so a burst is not piled onto one worker.
Neither goes to a worker where the request's client request, or (under a strategy fair between tenants,
while another tenant has requests queued) its tenant, already holds its share of the batch slots
(`batch_share.py`): such a request stays queued, and the round skips its client request's (or its
tenant's) other requests instead of passing over them one by one.

Failure: a worker that sends nothing (no heartbeat, no report) for `worker_timeout_s` is dropped, and every request it
held fails with UNAVAILABLE marked `retry` (the gateway fails it over to another worker with the
tokens already streamed); so is one the loop could not deliver a message to (`unreachable`: the
loop probes every worker when its socket monitor sees a disconnect), at once, and the request
whose ASSIGN bounced goes back to the head of the queue (it never started). Placement skips a
worker whose last report is older than `stale_after_s` (or whose step under way, as its heartbeats say,
has run longer: it is alive but slow), before it is declared dead, and one that
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
from loraserve.scheduler.adaptive.strategy import AdaptiveStrategy
from loraserve.scheduler.batch_share import NOT_FULL, BatchShare, Full
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
from loraserve.wire import Heartbeat, WorkerReport

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
MAX_PASSED = 64  # requests (or client requests held by their share) a round passes over before it stops
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
        self.share = BatchShare(self.config.share, self.cluster.holdings)
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

    def on_heartbeat(self, heartbeat: Heartbeat, now: float) -> bool:
        """A registered worker is alive (False: it is not registered, or not under this instance)."""
        return self.cluster.on_heartbeat(heartbeat, now)

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
        at_share: set[str] = set()  # client requests held back by their share this round: skipped
        cap = self.strategy.tenant_cap(now)
        in_flight = self.cluster.in_flight
        capped = {cap[0]} if cap is not None and in_flight[cap[0]] >= cap[1] else set()
        while (
            len(passed) + len(at_share) < MAX_PASSED
            and (request := self.queue.next_candidate(now, passed, capped, at_share)) is not None
        ):
            worker, full = self._within_share(request, now)
            if worker is not None and self.strategy.hold(request, worker, now):
                passed.add(request.request_id)
                held = True
                continue
            if worker is None:
                if not any(w.held < w.report.max_batch_size for w in self.cluster.fresh(now)):
                    break  # no batch room anywhere: nobody can be placed
                self._pass(request, full, now, passed, at_share, capped)
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

    def _within_share(self, request: QueuedRequest, now: float) -> tuple[WorkerView | None, Full]:
        """Where `request` goes now within its shares, and the workers where it is at one. Its tenant's
        share is looked at across the workers only when the worker chosen without it is at it."""
        full = self.share.full(request, self.workers, False)
        worker = self._choose(request, now, full.workers)
        others_waiting = self.strategy.tenant_fair and self.queue.tenants_waiting() > 1
        if worker is not None and others_waiting and self.share.tenant_full(request, worker):
            full = self.share.full(request, self.workers, True)
            worker = self._choose(request, now, full.workers)
        return worker, full

    def _pass(
        self, request: QueuedRequest, full: Full, now: float, passed: set[str], at_share: set[str], capped: set[str]
    ) -> None:
        """`request` could not be placed: pass over it; or, where its share held it back from a worker with
        room, skip its tenant (at its share on every fresh worker) or its client request for the round."""
        if full is NOT_FULL:
            passed.add(request.request_id)
            return
        at_share.add(request.request_key)
        if all(w.worker_id in full.by_tenant for w in self.cluster.fresh(now)):
            capped.add(request.tenant)

    def _choose(self, request: QueuedRequest, now: float, full: frozenset[str] = frozenset()) -> WorkerView | None:
        """Where `request` goes now (None: nowhere), never to a worker in `full` (at its share there)."""
        beside = self._beside_group(request, now, full)
        return beside if beside is not None else self.strategy.choose(request, now, full)

    def _beside_group(self, request: QueuedRequest, now: float, full: frozenset[str]) -> WorkerView | None:
        """The worker the request's prefill group went to, when it is fresh and has room for the request:
        there the prompt is computed once (shared prefill), whatever the strategy would choose."""
        worker_id = self._group_workers.get(request.group) if request.group is not None else None
        view = self.workers.get(worker_id) if worker_id is not None and worker_id not in full else None
        if view is None or not self.cluster.is_fresh(view, now):
            return None
        return view if self.strategy.fits(view, request, now) else None

    def _remember_group(self, group: str, worker_id: str) -> None:
        self._group_workers[group] = worker_id
        self._group_workers.move_to_end(group)
        while len(self._group_workers) > MAX_GROUPS:
            self._group_workers.popitem(last=False)
