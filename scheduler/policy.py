"""The scheduler's policy: a pure object (no sockets, no clocks of its own) driven by `loop.py`.

    policy.add(request, now)            admit to the bounded FCFS queue (or refuse)
    policy.cancel(request_id)           -> decisions
    policy.on_report(report, now)       a worker's state after a step (or a heartbeat)
    policy.schedule(now)                -> decisions: assignments, prefetch hints, failures

Placement follows Punica §5.1: the request at the head of the queue goes to the *busiest* ready
worker that still has batch room and pool room for the request's whole KV (prompt + max new
tokens) — consolidating load so that lightly loaded workers drain. Between reports the policy
counts its own assignments against a worker's room, so a burst is not piled onto one worker.
A request of a prefill group (`QueuedRequest.group`: the n choices of one prompt) goes to the worker
its group's last request went to while that worker has room, whatever else placement would choose:
there the prompt is computed once.

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
queued requests fail with UNAVAILABLE and `retry` after `worker_timeout_s` (their gateways wait
for a worker, within a bound, and submit them again).

`PolicyConfig.policy` picks how the queue is ordered, requests placed and adapters predicted:
`fcfs` is the behaviour described above; `adaptive` (the default) composes the parts in this
package instead — the multi-queue under VTC fairness (`queues.py`, `fairness.py`), SLO-aware early
refusal (`admission.py`), placement by the step-cost model with adapter affinity (`placement.py`,
`cost_model.py`), migration off overloaded workers (`migration.py`) and scored prefetch from the
queue, adapter popularity and adapters likely to come back (`popularity.py`). Its per-worker views
are made once per report and kept true as requests are assigned, and prediction and migration run
at most every `predict_interval_s` / `migrate_interval_s`, and placement in a large cluster costs only
its likely winners (`Placement.choose`): a decision's cost grows little with the cluster
(docs/benchmarks.md, "Scheduling"). Failure handling is the same under both.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from loraserve.errors import InvalidConfigError, ResourceExhaustedError, UnavailableError
from loraserve.prefix_keys import PrefixProbe
from loraserve.scheduler.adaptive import AdaptivePlanner
from loraserve.scheduler.admission import check_admission
from loraserve.scheduler.cost_model import StepCost
from loraserve.scheduler.fairness import TenantRates, VirtualTokenCounter, flooder_cap
from loraserve.scheduler.placement import WorkerLoad
from loraserve.scheduler.queues import FifoQueue, MultiQueue, SizeClasses
from loraserve.wire import AdapterKey, WorkerReport

POLICIES = ("adaptive", "fcfs")  # the first is the default
MAX_GROUPS = 4096  # prefill groups whose worker placement remembers (the most recent)
LOAD_REFRESH_S = 0.25  # a worker's placement view is made again at least this often (workers report as often)


@dataclass(frozen=True)
class PolicyConfig:
    max_queue_length: int = 1024
    worker_timeout_s: float = 1.5  # a worker silent this long is dead (workers report every 0.25 s)
    prefetch_depth: int = 16  # queued requests looked at when predicting adapters
    stale_after_s: float = 0.75  # no new placement on a worker silent this long (at most worker_timeout_s)
    max_zombies: int = 1024  # dropped workers remembered, to recognise one that comes back
    policy: str = POLICIES[0]  # "fcfs": the baseline above; "adaptive": the parts in this package
    # ---- adaptive only ----
    starvation_s: float = 5.0  # a request queued this long goes first and is overtaken no more
    size_classes: SizeClasses = field(default_factory=SizeClasses)  # Chameleon's weighted sizes and class bounds
    vtc_input_weight: float = 1.0  # VTC charge per prompt token
    vtc_output_weight: float = 2.0  # VTC charge per output token (budgeted)
    flood_share: float = 0.5  # a tenant holding this share of a queue 3/4 full is refused (others may come)
    # Of an equal split of batch slots, what the tenant with the largest backlog may hold while others are active.
    # On the real stack (docs/benchmarks.md, "Scheduling") 0.5 left a flooded victim's p99 TTFT at 2.2x its calm
    # value (steps grow with the batch on the emulated CPU device); 0.1 keeps it at 1.2x.
    flooder_slot_share: float = 0.1
    output_fraction: float = 0.5  # expected output as a share of max_new_tokens (cost and admission)
    step_cost: StepCost = field(default_factory=StepCost)  # the step-time model's starting coefficients (refit online)
    adapter_load_s: float = 0.05  # cost of placing a request where its adapter is not resident
    migrate_after_s: float = 2.0  # a request waiting on its worker this long may move (0: never)
    max_recompute_tokens: int = 256  # a running request moves (by recompute) only if it has computed at most this
    popularity_half_life_s: float = 30.0  # of the per-adapter EWMA arrival rate
    prefetch_horizon_s: float = 2.0  # popularity scores: the chance of a request within this
    min_prefetch_score: float = 0.2  # popular adapters less likely than this are not prefetched
    predict_interval_s: float = 0.02  # prefetch hints are planned at most this often (each round otherwise)
    migrate_interval_s: float = 0.1  # migrations are planned at most this often
    return_window_s: float = 10.0  # an adapter asked for again this soon after a request for it ended "returned"
    hold_slo_share: float = 0.5  # ... and at most this share of its TTFT target
    # A request whose adapter its busy worker lacks may wait this long for a prefetch there. Off: in the
    # scheduling benchmark a 40 ms hold raised the prefetch hit rate (0.03 -> 0.35 on `popularity`) but
    # worsened TTFT everywhere (popularity p99 34 -> 54 ms), since the worker fetches on ASSIGN anyway.
    prefetch_hold_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_queue_length < 1 or self.worker_timeout_s <= 0 or self.prefetch_depth < 0:
            raise InvalidConfigError(f"invalid scheduler policy config {self}")
        if self.stale_after_s <= 0 or self.max_zombies < 0:
            raise InvalidConfigError(f"invalid scheduler policy config {self}")
        if self.policy not in POLICIES:
            raise InvalidConfigError(f"unknown scheduling policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.max_recompute_tokens < 0:
            raise InvalidConfigError(f"max_recompute_tokens must be >= 0, got {self.max_recompute_tokens}")
        if self.starvation_s <= 0 or self.adapter_load_s < 0 or self.migrate_after_s < 0 or self.prefetch_hold_s < 0:
            raise InvalidConfigError(f"invalid scheduler policy config {self}")
        if not 0 < self.flood_share <= 1 or not 0 < self.output_fraction <= 1 or not 0 < self.flooder_slot_share <= 1:
            raise InvalidConfigError(f"invalid scheduler policy config {self}")
        if self.popularity_half_life_s <= 0 or self.prefetch_horizon_s <= 0 or not 0 <= self.min_prefetch_score <= 1:
            raise InvalidConfigError(f"invalid scheduler policy config {self}")
        if self.return_window_s <= 0 or self.predict_interval_s < 0 or self.migrate_interval_s < 0:
            raise InvalidConfigError(f"invalid scheduler policy config {self}")
        if self.vtc_input_weight < 0 or self.vtc_output_weight < 0:
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
    tenant: str = ""  # whose request (VTC fairness); "" is a tenant like any other
    ttft_slo_s: float | None = None  # time-to-first-token target from `arrival`; refused early if missed
    rank: int = 0  # the adapter's LoRA rank; 0: unknown (SizeClasses.default_rank is assumed)
    attempt: int = 0  # earlier attempts lost (failover, migration): only attempt 0 migrates
    placed_at: float = 0.0  # when it was assigned to a worker (set by the policy)
    group: str | None = None  # shared prefill: placed beside the group's other requests when there is room
    prefix: PrefixProbe | None = None  # prefix caching: its checkpoint fingerprints (adaptive placement)


@dataclass
class WorkerView:
    """A worker as the policy sees it: its last report, and sets derived from the report's lists.
    Placement asks for the sets many times a round, so they are built once per report, and only
    when the list they come from changed (`update`): a report costs what changed in it."""

    worker_id: str
    last_report: float
    report: WorkerReport
    assigned: set[str] = field(default_factory=set)  # request ids held by this worker
    resident: frozenset[AdapterKey] = field(init=False)  # report.resident
    running: frozenset[str] = field(init=False)  # report.running
    reported: frozenset[str] = field(init=False)  # report.running + report.waiting
    prefixes: frozenset[bytes] = frozenset()  # report.cached_prefixes, from the last report that carried them

    def __post_init__(self) -> None:
        self.resident = frozenset((name, int(version)) for name, version in self.report.resident)
        self.running = frozenset(self.report.running)
        self.reported = self.running | frozenset(self.report.waiting)
        self.prefixes = frozenset(self.report.prefixes())

    def update(self, report: WorkerReport, now: float) -> None:
        old, self.report, self.last_report = self.report, report, now
        if report.cached_prefixes is not None:
            self.prefixes = frozenset(report.prefixes())
        if report.resident != old.resident:
            self.resident = frozenset((name, int(version)) for name, version in report.resident)
        if report.running != old.running:
            self.running = frozenset(report.running)
        if report.running != old.running or report.waiting != old.waiting:
            self.reported = self.running | frozenset(report.waiting)

    def held(self) -> int:
        """Requests the worker holds: reported running/waiting plus assignments not yet reported."""
        return len(self.reported) + sum(1 for r in self.assigned if r not in self.reported)

    def unreported(self) -> list[str]:
        """Assignments the worker has not reported yet."""
        return [r for r in self.assigned if r not in self.reported]


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
    scores: tuple[float, ...] = ()  # parallel to adapters, each in [0, 1]; empty: unknown (fcfs)
    trace: tuple[tuple[str, str], ...] = ()  # a hint's: the trace of the request it is for (`scheduler/hints.py`)


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


@dataclass(frozen=True)
class Migrate:
    """Move `request` off `worker_id` by recompute: cancel it there, and fail it to its gateway with
    `retry` set, which submits it again (attempt + 1, queued at the head)."""

    worker_id: str
    request: QueuedRequest
    reason: str


Decision = AssignTo | CancelOn | PrefetchOn | Fail | WorkerGone | Migrate


class SchedulerPolicy:
    """Admission, placement, prediction and failure handling over plain data (see the module docstring).

    Owns the waiting queue, the view of every worker (last report, assignments not yet reported),
    which worker holds which request, and the dropped workers it still recognises.
    """

    def __init__(self, config: PolicyConfig | None = None):
        self.config = config or PolicyConfig()
        self.adaptive = self.config.policy == "adaptive"
        self.fairness = VirtualTokenCounter(self.config.vtc_input_weight, self.config.vtc_output_weight)
        self.queue: FifoQueue | MultiQueue = (
            MultiQueue(self.config.size_classes, self.config.starvation_s, self.fairness)
            if self.adaptive
            else FifoQueue()
        )
        self.planner = AdaptivePlanner(self.config)  # cost model, placement, popularity, prefetch, migration
        self.workers: dict[str, WorkerView] = {}
        # request id -> (worker, request); the request is None when adopted (placed by an earlier scheduler)
        self.placed: dict[str, tuple[str, QueuedRequest | None]] = {}
        self._in_flight: Counter[str] = Counter()  # tenant -> its requests in `placed` (adopted ones aside)
        self._rates = TenantRates()  # tenant -> arrivals per second: who floods the others
        self._fresh: tuple[float, list[WorkerView]] | None = None  # `_fresh_workers`' answer at a time
        self._next_predict = self._next_migrate = -math.inf  # adaptive: when prediction and migration run next
        self._held = False
        self._zombies: OrderedDict[str, str] = OrderedDict()  # dropped worker id -> its instance then
        self._prefetch_sent: dict[str, tuple] = {}
        self._no_worker_since: float | None = None
        # Each worker's (requests held, KV pages reserved) and placement view (with when it was made),
        # computed when asked after its report, updated in place as requests are assigned to it, and
        # dropped when it reports or loses requests (see `_counts`, `_invalidate`).
        self._worker_counts: dict[str, tuple[int, int]] = {}
        self._worker_loads: dict[str, tuple[WorkerLoad, float]] = {}
        self._deadlines: list[tuple[float, str]] = []  # (deadline, request id) of queued requests: a heap
        self._group_workers: OrderedDict[str, str] = OrderedDict()  # prefill group -> its last worker

    # ---- inputs --------------------------------------------------------------------------------
    def ready_workers(self) -> list[WorkerView]:
        """Workers that take new requests: warmed up and not draining."""
        return [w for w in self.workers.values() if w.report.ready and not w.report.draining]

    def add(self, request: QueuedRequest, now: float, resumed: bool = False) -> int:
        """Queue a request; returns how many are ahead of it.

        A `resumed` request (failed over from a lost worker, tokens already streamed) was admitted
        before: it goes to the head of the queue, and a full queue does not refuse it. Under
        `adaptive`, a new request is also refused early when it cannot meet its TTFT target or
        deadline, or when its tenant floods a nearly full queue.
        """
        ready = self.ready_workers()
        if not ready:
            raise UnavailableError("no worker is ready to serve requests; try again shortly")
        if len(self.queue) >= self.config.max_queue_length and not resumed:
            raise ResourceExhaustedError(
                f"the scheduler queue is full ({self.config.max_queue_length} requests waiting); retry later"
            )
        if not any(self._fits_ever(w, request) for w in ready):
            raise ResourceExhaustedError(
                f"no worker's pool can ever hold this request ({request.prompt_len} prompt + "
                f"{request.max_new_tokens} new tokens); lower max_new_tokens"
            )
        request.enqueued = now
        if not resumed:
            self.planner.arrived(request, now)
            self._rates.arrived(request.tenant, now)
        if resumed:
            self._enqueue(request, front=True)
            return 0
        if not self.adaptive:
            self._enqueue(request)
            return len(self.queue) - 1
        self._check_flood(request)
        ahead = self.queue.ahead(request, now)
        if request.ttft_slo_s is not None or request.deadline is not None:
            estimate = self.planner.estimate(self._loads(now), request, ahead)
            check_admission(estimate, now, request.arrival, request.ttft_slo_s, request.deadline)
        self._enqueue(request)
        return ahead

    def _enqueue(self, request: QueuedRequest, front: bool = False) -> None:
        self.queue.push(request, front=front)
        if request.deadline is not None:  # `_expire` looks only at these
            heapq.heappush(self._deadlines, (request.deadline, request.request_id))

    def _check_flood(self, request: QueuedRequest) -> None:
        assert isinstance(self.queue, MultiQueue)
        limit = self.config.max_queue_length
        if len(self.queue) < 0.75 * limit or self.fairness.known_tenants() < 2:
            return
        if self.queue.count(request.tenant) >= self.config.flood_share * len(self.queue):
            raise ResourceExhaustedError(
                f"tenant {request.tenant!r} holds {self.queue.count(request.tenant)} of the "
                f"{len(self.queue)} queued requests (the queue takes {limit}); retry later"
            )

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
        placed = self._unplace(request_id)
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
        view.update(report, now)
        self._invalidate(view.worker_id)
        self.planner.observe(report)
        for request_id in report.finished:
            view.assigned.discard(request_id)
            placed = self._unplace(request_id)
            if self.adaptive and placed is not None and placed[1] is not None:
                self.planner.ended(placed[1], now)
        if report.fatal:  # its last report: it crashed, or drained and stops
            how = "stopped" if report.draining else "failed"
            decisions += self._drop(view, f"worker {report.worker_id} {how}: {report.fatal}")
        return decisions

    def unreachable(self, worker_id: str, request_id: str | None = None) -> list[Decision]:
        """A message to `worker_id` could not be delivered: the worker is gone. Drop it (what it held
        fails) and put `request_id`, whose ASSIGN bounced, back at the head of the queue."""
        placed = self._unplace(request_id) if request_id else None
        view = self.workers.get(worker_id)
        if view is not None and request_id:
            view.assigned.discard(request_id)
        if placed is not None and placed[1] is not None:
            self._enqueue(placed[1], front=True)
        return self._drop(view, f"worker {worker_id} is unreachable") if view is not None else []

    def hint_target(self, request: QueuedRequest, now: float) -> str | None:
        """The worker a request like `request` would be placed on now, if it neither holds its adapter nor
        (adaptive) is loading it; from then on it counts as loading it, so placement follows the hint. For
        the gateway's early hints (`scheduler/hints.py`), before the request itself is submitted."""
        worker = self._choose(request, now) if request.adapter is not None else None
        if worker is None or request.adapter in worker.resident:
            return None
        if self.adaptive:
            if request.adapter in self._load_of(worker, now).adapters:
                return None
            self.planner.loading(worker.worker_id, request.adapter, now)
            self._invalidate(worker.worker_id)
        return worker.worker_id

    # ---- the scheduling round ------------------------------------------------------------------
    def schedule(self, now: float) -> list[Decision]:
        return self._schedule(now)

    def _schedule(self, now: float) -> list[Decision]:
        decisions: list[Decision] = []
        for view in list(self.workers.values()):
            if now - view.last_report > self.config.worker_timeout_s:
                decisions += self._drop(view, f"worker {view.worker_id} stopped responding")
        decisions += self._expire(now)
        decisions += self._place(now)
        if self.adaptive:  # each at most every its interval: their work grows with the cluster, not with a round
            if now >= self._next_migrate or now < self._next_migrate - self.config.migrate_interval_s:
                self._next_migrate = now + self.config.migrate_interval_s
                decisions += self._migrate(now)
            due = now >= self._next_predict or now < self._next_predict - self.config.predict_interval_s
            if due or self._held:  # a request held for its prefetch needs the hint this round
                self._next_predict = now + self.config.predict_interval_s
                decisions += self._predict_adaptive(now)
        else:
            decisions += self._predict()
        return decisions

    def _drop(self, view: WorkerView, reason: str) -> list[Decision]:
        del self.workers[view.worker_id]
        self._invalidate(view.worker_id)
        self._prefetch_sent.pop(view.worker_id, None)
        self.planner.forget_worker(view.worker_id)
        self._zombies[view.worker_id] = view.report.instance
        while len(self._zombies) > self.config.max_zombies:
            self._zombies.popitem(last=False)
        decisions: list[Decision] = [WorkerGone(view.worker_id, reason)]
        for request_id in sorted(view.assigned):
            placed = self._unplace(request_id)
            if placed is not None and placed[1] is not None:  # adopted ones: their gateway watches the cluster
                decisions.append(Fail(placed[1], "UNAVAILABLE", f"{reason}; the request was lost", retry=True))
        return decisions

    def _expire(self, now: float) -> list[Decision]:
        decisions: list[Decision] = []
        while self._deadlines and self._deadlines[0][0] <= now:  # only queued requests with a deadline
            _, request_id = heapq.heappop(self._deadlines)
            request = self.queue.remove(request_id)
            if request is not None:
                decisions.append(Fail(request, "DEADLINE_EXCEEDED", "the deadline passed while the request was queued"))
        if self.ready_workers():
            self._no_worker_since = None
        elif self.queue:
            self._no_worker_since = self._no_worker_since or now
            if now - self._no_worker_since >= self.config.worker_timeout_s:
                for request in self.queue.values():
                    message = "no worker is available to serve the request"
                    decisions.append(Fail(request, "UNAVAILABLE", message, retry=True))  # its gateway waits for one
                self.queue.clear()
        return decisions

    def _place(self, now: float) -> list[Decision]:
        decisions: list[Decision] = []
        self._held = False  # a request was held for its adapter's prefetch this round
        passed: set[str] = set()  # could not be placed this round (adaptive: others may overtake them)
        in_flight, cap = self._tenant_slots(now)
        capped = {cap[0]} if cap is not None and in_flight[cap[0]] >= cap[1] else set()
        while len(passed) < 64 and (request := self.queue.next_candidate(now, passed, capped)) is not None:
            worker = self._choose(request, now)
            if worker is not None and self._hold_for_prefetch(request, worker, now):
                passed.add(request.request_id)
                self._held = True
                continue
            if worker is None:
                passed.add(request.request_id)
                if not any(self._load(w) < w.report.max_batch_size for w in self._fresh_workers(now)):
                    break  # no batch room anywhere: nobody can be placed
                continue
            self.queue.remove(request.request_id)
            self.queue.taken(request)
            request.placed_at = now
            self._assigned_to(worker, request)
            worker.assigned.add(request.request_id)
            self.placed[request.request_id] = (worker.worker_id, request)
            self._in_flight[request.tenant] += 1
            if request.group is not None:
                self._remember_group(request.group, worker.worker_id)
            if request.adapter is not None:
                self.planner.loading(worker.worker_id, request.adapter, now)
            if self.adaptive and request.prefix is not None:
                self.planner.caching(worker.worker_id, request.prefix, worker.report.tokens_per_page, now)
            decisions.append(AssignTo(worker.worker_id, request))
            if cap is not None and request.tenant == cap[0] and in_flight[request.tenant] >= cap[1]:
                capped.add(request.tenant)
        return decisions

    def _hold_for_prefetch(self, request: QueuedRequest, worker: WorkerView, now: float) -> bool:
        """adaptive: keep a new request queued up to `prefetch_hold_s` (and half its TTFT target)
        while its chosen worker, busy with others, prefetches its adapter in the background (the
        hint goes out this round), so that no step of that batch waits for the adapter's copy and
        the request's first step finds it loaded. An idle worker is not held for: nobody waits
        there. Costs up to the hold in TTFT for a request whose adapter is cold; 0 turns it off."""
        until = request.enqueued + self.config.prefetch_hold_s
        if request.ttft_slo_s is not None:  # spend at most a share of the TTFT target waiting
            until = min(until, request.arrival + self.config.hold_slo_share * request.ttft_slo_s)
        return (
            self.adaptive
            and request.adapter is not None
            and request.attempt == 0
            and now < until
            and request.adapter not in worker.resident
            and self._load(worker) > 0
        )

    def _tenant_slots(self, now: float) -> tuple[Counter[str], tuple[str, int] | None]:
        """Requests each tenant holds on workers (kept as requests are placed and end: `_unplace`), and
        (adaptive, several tenants active) the flooding tenant with the most slots it may hold
        (`fairness.flooder_cap`)."""
        in_flight = self._in_flight
        if not isinstance(self.queue, MultiQueue):
            return in_flight, None
        slots = sum(w.report.max_batch_size for w in self._fresh_workers(now))
        share = self.config.flooder_slot_share
        return in_flight, flooder_cap(
            in_flight, self.queue.backlogs(), slots, share, lambda t: self._rates.rate(t, now)
        )

    def _load(self, view: WorkerView) -> int:
        """Requests the worker holds: reported running/waiting plus assignments not yet reported."""
        return self._counts(view)[0]

    def _counts(self, view: WorkerView) -> tuple[int, int]:
        """(requests held, KV pages reserved by unreported assignments). Computed once per report of the
        worker, however many requests are placed meanwhile: a worker's lists can be thousands long
        (bounded by the wire), and every placement asks about every worker."""
        counts = self._worker_counts.get(view.worker_id)
        if counts is None:
            requests = (self.placed[r][1] for r in view.unreported() if r in self.placed)
            counts = view.held(), sum(self._kv_pages(view, r) for r in requests if r is not None)
            self._worker_counts[view.worker_id] = counts
        return counts

    def _assigned_to(self, view: WorkerView, request: QueuedRequest) -> None:
        """Keep the cached view of `view` true after `request` is assigned to it."""
        if view.worker_id in self._worker_counts:
            held, reserved = self._worker_counts[view.worker_id]
            self._worker_counts[view.worker_id] = held + 1, reserved + self._kv_pages(view, request)
        if view.worker_id in self._worker_loads:
            load, made = self._worker_loads[view.worker_id]
            self._worker_loads[view.worker_id] = self.planner.with_request(load, request), made

    def _invalidate(self, worker_id: str) -> None:
        """`worker_id` reported, lost requests, is loading an adapter or is gone: compute its view again."""
        self._worker_counts.pop(worker_id, None)
        self._worker_loads.pop(worker_id, None)
        self._fresh = None

    def _room_pages(self, view: WorkerView) -> int:
        """Pool pages still free for KV, counting what unreported assignments will take."""
        report = view.report
        return report.free_pages + report.evictable_pages - self._reserved_pages(view)

    def _reserved_pages(self, view: WorkerView) -> int:
        """KV pages that assignments the worker has not reported yet will take."""
        return self._counts(view)[1]

    def _unplace(self, request_id: str) -> tuple[str, QueuedRequest | None] | None:
        """Forget where `request_id` was placed (it ended, failed or moved); (worker id, request) or None."""
        placed = self.placed.pop(request_id, None)
        if placed is not None:
            self._invalidate(placed[0])
        if placed is not None and placed[1] is not None:
            tenant = placed[1].tenant
            self._in_flight[tenant] -= 1
            if self._in_flight[tenant] <= 0:
                del self._in_flight[tenant]
        return placed

    def _placed_request(self, request_id: str) -> QueuedRequest | None:
        placed = self.placed.get(request_id)
        return placed[1] if placed is not None else None

    @staticmethod
    def _kv_pages(view: WorkerView, request: QueuedRequest) -> int:
        tokens = request.prompt_len + request.max_new_tokens
        return -(-tokens // max(1, view.report.tokens_per_page))

    def _fits_ever(self, view: WorkerView, request: QueuedRequest) -> bool:
        return self._kv_pages(view, request) <= view.report.total_pages

    def _fresh_workers(self, now: float) -> list[WorkerView]:
        """Ready workers whose last report is recent enough to place on; made once per `now` (a round
        asks many times) and again after any report, since a report can change any of it."""
        if self._fresh is None or self._fresh[0] != now:
            fresh_s = min(self.config.stale_after_s, self.config.worker_timeout_s)
            self._fresh = now, [w for w in self.ready_workers() if now - w.last_report <= fresh_s]
        return self._fresh[1]

    def _loads(self, now: float) -> list[WorkerLoad]:
        """The fresh workers as adaptive placement sees them."""
        workers = self._fresh_workers(now)
        return [self._load_of(w, now) for w in workers]

    def _load_of(self, view: WorkerView, now: float) -> WorkerLoad:
        """The worker as placement sees it; made again after LOAD_REFRESH_S at most, as what it is
        loading and the prefixes placed there expire with time (`adaptive.LOADING_S`)."""
        cached = self._worker_loads.get(view.worker_id)
        if cached is not None and 0 <= now - cached[1] <= LOAD_REFRESH_S:
            return cached[0]
        load = self.planner.load_of(view, self._placed_request, self._reserved_pages(view), now)
        self._worker_loads[view.worker_id] = load, now
        return load

    def _remember_group(self, group: str, worker_id: str) -> None:
        self._group_workers[group] = worker_id
        self._group_workers.move_to_end(group)
        while len(self._group_workers) > MAX_GROUPS:
            self._group_workers.popitem(last=False)

    def _choose(self, request: QueuedRequest, now: float) -> WorkerView | None:
        beside = self._beside_group(request, now)
        if beside is not None:
            return beside
        if self.adaptive:
            chosen = self.planner.placement.choose(self._loads(now), self.planner.demand(request))
            return self.workers[chosen.worker_id] if chosen is not None else None
        candidates = [
            w
            for w in self._fresh_workers(now)
            if self._load(w) < w.report.max_batch_size and self._kv_pages(w, request) <= self._room_pages(w)
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

    def _beside_group(self, request: QueuedRequest, now: float) -> WorkerView | None:
        """The worker the request's prefill group went to, when it is fresh and has room for the request:
        there the prompt is computed once (shared prefill), whatever the cost model would say."""
        worker_id = self._group_workers.get(request.group) if request.group is not None else None
        view = self.workers.get(worker_id) if worker_id is not None else None
        if view is None or view not in self._fresh_workers(now):
            return None
        if self.adaptive:
            fits = self.planner.placement.fits(self._load_of(view, now), self.planner.demand(request))
        else:
            fits = self._load(view) < view.report.max_batch_size and self._kv_pages(view, request) <= self._room_pages(
                view
            )
        return view if fits else None

    def _migrate(self, now: float) -> list[Decision]:
        if not self.config.migrate_after_s:
            return []
        workers = self._fresh_workers(now)
        loads = self._loads(now)
        waiting, running = [], []
        for view in workers:
            for ids, into in ((view.report.waiting, waiting), (view.report.running, running)):
                for request_id in ids:
                    request = self._placed_request(request_id)
                    if request is not None and request.attempt == 0 and self.placed[request_id][0] == view.worker_id:
                        into.append((view.worker_id, request))
        decisions: list[Decision] = []
        for move in self.planner.migrations(loads, waiting, running, now):
            _, request = self._unplace(move.request_id)
            self.workers[move.source].assigned.discard(move.request_id)
            self._invalidate(move.source)
            assert request is not None
            reason = f"migrated from overloaded worker {move.source} to idle worker {move.target}"
            decisions.append(Migrate(move.source, request, reason))
        return decisions

    def _predict(self) -> list[Decision]:
        """fcfs: the adapters of the next queued requests, to every ready worker that lacks them."""
        wanted: list[AdapterKey] = []
        for request in self.queue.values()[: self.config.prefetch_depth]:
            if request.adapter is not None and request.adapter not in wanted:
                wanted.append(request.adapter)
        decisions: list[Decision] = []
        for view in self.ready_workers():
            missing = tuple(k for k in wanted if k not in view.resident)
            if missing and missing != self._prefetch_sent.get(view.worker_id):
                decisions.append(PrefetchOn(view.worker_id, missing))
            self._prefetch_sent[view.worker_id] = missing
        return decisions

    def _predict_adaptive(self, now: float) -> list[Decision]:
        """adaptive: scored hints, each only to the worker that would serve it (`popularity.py`)."""
        workers = self._fresh_workers(now)
        loads = self._loads(now)
        upcoming = self.queue.upcoming(now, self.config.prefetch_depth)
        plan = self.planner.prefetch(loads, upcoming, now)
        decisions: list[Decision] = []
        for view in workers:
            adapters, scores = plan.for_worker(view.worker_id)
            sent = (adapters, scores)
            if adapters and sent != self._prefetch_sent.get(view.worker_id):
                decisions.append(PrefetchOn(view.worker_id, adapters, scores))
                for adapter in adapters:
                    self.planner.loading(view.worker_id, adapter, now)
                self._invalidate(view.worker_id)
            self._prefetch_sent[view.worker_id] = sent
        return decisions
