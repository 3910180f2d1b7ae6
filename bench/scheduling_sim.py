"""A discrete-event simulation of the stack that drives the REAL scheduler policy and the REAL worker
step scheduler, with step and adapter-load times from a cost model measured on the real engine.

    sim = Simulation(trace, SchedulerPolicy(PolicyConfig(policy="fcfs")), SimConfig(), costs, model, slo_of)
    result = sim.run()          # a SimResult: one outcome per request, and each worker's counters

What is real and what is simulated:

- **Scheduler:** the `SchedulerPolicy` object itself, called exactly as `scheduler/loop.py` calls it —
  `add` on each arrival (a refusal is an outcome), `on_report` on each worker report, `schedule`
  after each of those and every `tick_s` — and its decisions carried out as the loop does
  (ASSIGN / PREFETCH / CANCEL to a worker, failures to the client, a migration as a cancel plus
  a resubmission at the head of the queue with `attempt` + 1).
- **Workers:** `SimWorker` holds the real `StepScheduler` (continuous batching up to
  `max_batch_size`, chunked prefill within `max_batched_tokens`, LRU eviction, preemption by
  recompute) over `SimPool`, which keeps the real `PagePool` bookkeeping (KV and adapters share
  the pages) and mirrors `UnifiedPool`'s loads: `ensure` (a miss, copied on the step), and
  `prefetch` (background copies, one at a time, evicting only lower-scored idle adapters). Like
  `worker/service.py`, a worker fetches an adapter it has never seen from the store on one of two
  fetch threads (the request waits, parked), handles messages between steps, and reports after
  every step (and every `report_interval_s` when idle) with the fields the real worker sends.
- **Time:** a step lasts `costs.step_s(its batch)` plus the copies it waited for; messages take
  `link_s` each way. Nothing else costs time (the scheduler's own CPU time is not charged).

Everything is deterministic: the same trace, policy and costs give the same result.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from loraserve.bench.scheduling_traces import SimRequest, SimTrace
from loraserve.bench.synthetic_adapters import DEFAULT_TARGETS
from loraserve.errors import LoraserveError
from loraserve.model_config import ModelConfig
from loraserve.scheduler.policy import AssignTo, CancelOn, Fail, Migrate, PrefetchOn, QueuedRequest, WorkerGone
from loraserve.wire import AdapterKey, WorkerReport
from loraserve.worker.page_pool import PagePool
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.request import FinishReason, Request, Status
from loraserve.worker.sampling import SamplingParams
from loraserve.worker.step_costs import CostModel, StepFeatures, step_features
from loraserve.worker.step_scheduler import StepPlan, StepScheduler
from loraserve.worker.unified_pool import UNKNOWN_SCORE, LoadStats, prefetch_targets

log = logging.getLogger(__name__)

TOKEN = 3  # every generated token (the simulation never looks at token ids)


@dataclass(frozen=True)
class SimConfig:
    workers: int = 2
    max_batch_size: int = 32
    max_batched_tokens: int = 2048
    pool_pages: int = 1536
    rows_per_page: int = 32
    fetch_threads: int = 2
    report_interval_s: float = 0.25  # a worker's heartbeat when idle (worker/service.py)
    tick_s: float = 0.05  # the scheduler loop's round timer (scheduler/loop.py)
    link_s: float = 0.0005  # one message between two processes on loopback
    prefetch_reserve: float = 0.10  # EngineConfig.prefetch_reserve
    prefetch_depth: int = 16  # EngineConfig.prefetch_depth: the worker's own look-ahead
    drain_s: float = 60.0  # after the last arrival; requests still unfinished then are cut
    check_invariants: bool = False  # check the page pool after every step (tests)


# ---- the pool --------------------------------------------------------------------------------------
class SimPool:
    """`UnifiedPool`'s interface over the real `PagePool`, with copies that take simulated time."""

    def __init__(self, layout: PoolLayout, footprint: Callable[[AdapterKey], tuple[int, int]], copy_s, now):
        self.layout = layout
        self._pages = PagePool(layout)
        self._footprint = footprint  # key -> (pages, useful elements)
        self._copy_s = copy_s  # key -> seconds
        self._now = now  # () -> the simulated time
        self._copying: dict[AdapterKey, float] = {}  # pinned until their copy is done at this time
        self._unused: dict[AdapterKey, tuple[float, bool]] = {}  # copied in the background, not yet used
        self._scores: dict[AdapterKey, float] = {}
        self.copier_free = 0.0
        self.step_copy_s = 0.0  # on-demand copies charged to the step being planned
        self.stats = LoadStats()
        self.demand_copies = 0  # background copies started because requests were already waiting

    # queries, KV, pins: as UnifiedPool
    def is_resident(self, key: AdapterKey) -> bool:
        return self._pages.is_resident(key)

    def resident_adapters(self) -> list[AdapterKey]:
        return self._pages.resident_adapters()

    def evictable_pages(self) -> int:
        return self._pages.evictable_pages()

    def page_stats(self):
        return self._pages.stats()

    def slot(self, key: AdapterKey) -> None:
        return None  # the runner is not simulated: nothing reads a slot

    def copying(self) -> bool:
        return bool(self._copying)

    def check_invariants(self) -> None:
        self._pages.check_invariants()

    def kv_page_table(self, seq) -> list[int]:
        return self._pages.kv_page_table(seq)

    def kv_pages_to_grow(self, seq, num_tokens: int) -> int:
        return self._pages.kv_pages_to_grow(seq, num_tokens)

    def grow_kv(self, seq, num_tokens: int) -> bool:
        return self._pages.grow_kv(seq, num_tokens)

    def free_kv(self, seq) -> None:
        self._pages.free_kv(seq)

    def pin(self, key: AdapterKey) -> None:
        self._pages.pin(key)

    def unpin(self, key: AdapterKey) -> None:
        self._pages.unpin(key)

    def score(self, key: AdapterKey) -> float:
        return self._scores.get(key, UNKNOWN_SCORE)

    def remember_scores(self, scores) -> None:
        for key, score in scores:
            self._scores[key] = min(1.0, max(0.0, score))

    # loads
    def make_room(self, num_pages: int, keep: frozenset = frozenset(), for_kv: bool = False) -> bool:
        evicted = self._pages.evict_for(num_pages, keep=keep, for_kv=for_kv)
        if evicted is None:
            return False
        for key in evicted:
            self._unused.pop(key, None)
            self.stats.evictions += 1
        return True

    def _allocate(self, key: AdapterKey, keep: frozenset, extra_pages: int = 0) -> bool:
        pages, useful = self._footprint(key)
        if not self.make_room(pages + extra_pages, keep=keep):
            return False
        return self._pages.allocate_adapter(key, pages, useful) is not None

    def ensure(self, key: AdapterKey, keep: frozenset = frozenset()) -> bool:
        if self.is_resident(key):
            return True
        if not self._allocate(key, keep):
            return False
        self.step_copy_s += self._copy_s(key)
        self.stats.misses += 1
        self.stats.loads += 1
        return True

    def prefetch(
        self, keys: list[AdapterKey], reserve_pages: int, needed: frozenset = frozenset(), demand: bool = False
    ) -> list[AdapterKey]:
        """As `UnifiedPool.prefetch`; `demand`: the copy is for requests already parked on it (a
        fetched adapter), so when a step uses it, it counts as a miss, not as a prefetch hit."""
        started = []
        for key, keep in prefetch_targets(keys, needed, self.is_resident, self.resident_adapters, self.score):
            if not self._allocate(key, keep, extra_pages=reserve_pages):
                continue
            self._pages.pin(key)
            done = max(self._now(), self.copier_free) + self._copy_s(key)  # one copy thread
            self.copier_free = done
            self._copying[key] = done
            self._unused[key] = (done, demand)
            self.stats.prefetches += 1
            self.stats.loads += 1
            self.demand_copies += demand
            started.append(key)
        return started

    def settle(self) -> None:
        now = self._now()
        for key in [k for k, done in self._copying.items() if done <= now]:
            del self._copying[key]
            self._pages.unpin(key)

    def next_copy_done(self) -> float | None:
        return min(self._copying.values(), default=None)

    def wait_ready(self, key: AdapterKey) -> float:
        """Seconds a step waits for `key`'s background copy; counts hits (demand copies count as misses)."""
        if key not in self._unused:
            return 0.0
        done, demand = self._unused.pop(key)
        now = self._now()
        if demand:
            self.stats.misses += 1
        elif done <= now:
            self.stats.prefetch_hits += 1
        else:
            self.stats.prefetch_late += 1
        return max(0.0, done - now)


# ---- a worker --------------------------------------------------------------------------------------
@dataclass
class WorkerCounters:
    steps: int = 0
    busy_s: float = 0.0
    max_running: int = 0
    preemptions: int = 0
    fetches: int = 0
    stuck: int = 0  # steps with work but nothing schedulable and nothing in flight (should stay 0)
    tokens: int = 0  # tokens computed (prefill + decode, recomputation included)


class SimWorker:
    """One worker as `worker/service.py` + `Engine` behave, on the simulated pool and clock."""

    def __init__(self, worker_id: str, config: SimConfig, model: ModelConfig, costs: CostModel, ranks: dict[str, int]):
        self.worker_id, self.config, self.costs, self.ranks = worker_id, config, costs, ranks
        self.layout = PoolLayout.for_model(model, config.rows_per_page, config.pool_pages)
        footprints = {r: self.layout.adapter_layout(model, r, DEFAULT_TARGETS) for r in sorted(set(ranks.values()))}
        self.now = 0.0
        self.pool = SimPool(
            self.layout,
            lambda key: (footprints[ranks[key[0]]].num_pages, footprints[ranks[key[0]]].useful_elements),
            lambda key: costs.copy_s(ranks[key[0]]),
            lambda: self.now,
        )
        self.scheduler = StepScheduler(self.pool, config.max_batch_size, config.max_batched_tokens)
        self.reserve = int(config.pool_pages * config.prefetch_reserve)
        self.inbox: list = []
        self.host: set[AdapterKey] = set()  # adapters fetched from the store (the worker keeps them all)
        self.fetching: dict[AdapterKey, tuple[float, bool]] = {}  # -> (done at, for a prefetch)
        self.fetch_free = [0.0] * config.fetch_threads
        self.parked: dict[AdapterKey, list[Request]] = {}
        self.requests: dict[str, Request] = {}
        self.finished: list[str] = []  # since the last report
        self.step_samples: list[tuple] = []  # since the last report (if the report carries them)
        self.plan: StepPlan | None = None
        self.step_started = 0.0
        self.busy = False
        self.last_report = 0.0
        self.counters = WorkerCounters()

    # messages (applied between steps, as the real worker drains its socket)
    def _drain_inbox(self) -> None:
        for decision in self.inbox:
            if isinstance(decision, AssignTo):
                self._on_assign(decision.request)
            elif isinstance(decision, PrefetchOn):
                self._on_prefetch(decision)
            elif isinstance(decision, CancelOn):
                for request_id in decision.request_ids:
                    self._cancel(request_id)
        self.inbox.clear()

    def _on_assign(self, queued: QueuedRequest) -> None:
        r: SimRequest = queued.payload
        key = (r.adapter, 1) if r.adapter else None
        request = Request(r.request_id, [TOKEN] * r.prompt_len, SamplingParams(max_new_tokens=r.output_len), key)
        self.requests[r.request_id] = request
        if key is None or key in self.host:
            self.scheduler.add(request)
            return
        self.parked.setdefault(key, []).append(request)
        if key not in self.fetching:
            self._fetch(key, for_prefetch=False)

    def _on_prefetch(self, decision: PrefetchOn) -> None:
        scores = decision.scores
        keys = list(decision.adapters)
        if scores:
            self.pool.remember_scores(zip(keys, scores, strict=True))
        self._engine_prefetch([k for k in keys if k in self.host])
        for key in keys:
            if key not in self.host and key not in self.fetching:
                self._fetch(key, for_prefetch=True)

    def _cancel(self, request_id: str) -> None:
        """Between steps, as `Engine.abort` + the next step: the request ends and frees its pages."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for waiting in self.parked.values():
            if request in waiting:
                waiting.remove(request)
                break
        else:
            self.scheduler.finish(request, FinishReason.CANCELLED)
        self.finished.append(request_id)

    def _fetch(self, key: AdapterKey, for_prefetch: bool) -> None:
        thread = min(range(len(self.fetch_free)), key=self.fetch_free.__getitem__)
        done = max(self.now, self.fetch_free[thread]) + self.costs.fetch_s(self.ranks[key[0]])
        self.fetch_free[thread] = done
        self.fetching[key] = (done, for_prefetch)
        self.counters.fetches += 1

    def _register_fetched(self) -> None:
        for key, (done, for_prefetch) in sorted(self.fetching.items(), key=lambda item: item[1]):
            if done > self.now:
                continue
            del self.fetching[key]
            self.host.add(key)
            waiting = self.parked.pop(key, [])
            for request in waiting:
                self.scheduler.add(request)
            if for_prefetch or waiting:
                self._engine_prefetch([key], demand=bool(waiting))

    def _engine_prefetch(self, keys: list[AdapterKey], demand: bool = False) -> None:
        needed = frozenset(r.adapter for r in self.scheduler.waiting if r.adapter is not None)
        self.pool.prefetch(keys, self.reserve, needed, demand)

    def next_wake(self) -> float | None:
        """When something this idle worker waits for (a fetch, a copy) is done."""
        times = [done for done, _ in self.fetching.values()]
        copy = self.pool.next_copy_done()
        return min([*times, *([copy] if copy is not None else [])], default=None)

    # the step
    def begin(self, now: float) -> float | None:
        """Start a step if there is work; returns when it ends (None: idle)."""
        self.now = now
        self._drain_inbox()
        self._register_fetched()
        self.pool.settle()
        if not self.scheduler.has_work():
            return None
        self.pool.step_copy_s = 0.0
        plan = self.scheduler.schedule()
        self.counters.preemptions += len(plan.preempted)
        if not plan.scheduled:
            if not self.scheduler.running and not self.pool.copying() and self.scheduler.waiting:
                self.counters.stuck += 1  # the real engine fails the head request: it can never fit
                head = self.scheduler.waiting[0]
                self.scheduler.finish(head, FinishReason.ERROR, "does not fit in the page pool")
                self.requests.pop(head.request_id, None)
                self.finished.append(head.request_id)
            return None
        waited = max((self.pool.wait_ready(k) for k in plan.adapters), default=0.0)
        waiting = itertools.islice(self.scheduler.waiting, self.config.prefetch_depth)
        self._engine_prefetch([r.adapter for r in waiting if r.adapter is not None])
        shape = self._shape(plan)
        seconds = self.costs.step_s(shape) + self.pool.step_copy_s + waited
        kv_pages = sum(self.layout.kv_pages_for(r.num_computed + n) for r, n in plan.scheduled)
        self.step_samples.append((shape.tokens, shape.token_rank, shape.adapters, kv_pages, seconds))
        self.plan, self.step_started, self.busy = plan, now, True
        self.counters.max_running = max(self.counters.max_running, len(self.scheduler.running))
        self.counters.tokens += shape.tokens
        return now + seconds

    def _shape(self, plan: StepPlan) -> StepFeatures:
        return step_features(
            [
                (n, r.num_computed + n, self.ranks[r.adapter[0]] if r.adapter else 0, r.adapter)
                for r, n in plan.scheduled
            ]
        )

    def end(self, now: float) -> list[tuple[str, str]]:
        """Apply the step's results (as `Engine._update`); returns [(request id, "first" | "done")]."""
        self.now = now
        events = []
        for request, n in self.plan.scheduled:
            if request.status is not Status.RUNNING:
                continue
            request.num_computed += n
            if request.num_computed < request.num_tokens:
                continue  # a prefill chunk that does not end its prompt
            request.output_ids.append(TOKEN)
            if request.first_token is None:
                request.first_token = now
                events.append((request.request_id, "first"))
            if len(request.output_ids) >= request.sampling.max_new_tokens:
                self.scheduler.finish(request, FinishReason.LENGTH)
                del self.requests[request.request_id]
                self.finished.append(request.request_id)
                events.append((request.request_id, "done"))
        self.counters.steps += 1
        self.counters.busy_s += now - self.step_started
        self.plan, self.busy = None, False
        if self.config.check_invariants:
            self.pool.check_invariants()
        return events

    def report(self, now: float) -> WorkerReport:
        """What `WorkerService._report` sends."""
        pool, stats = self.pool.page_stats(), self.pool.stats
        report = WorkerReport(
            worker_id=self.worker_id,
            ready=True,
            max_batch_size=self.config.max_batch_size,
            total_pages=pool.total_pages,
            free_pages=pool.free_pages,
            kv_pages=pool.kv_pages,
            adapter_pages=pool.adapter_pages,
            running=[r.request_id for r in self.scheduler.running],
            waiting=[r.request_id for r in self.scheduler.waiting]
            + [r.request_id for parked in self.parked.values() for r in parked],
            resident=[list(k) for k in self.pool.resident_adapters()],
            finished=self.finished,
            evictable_pages=self.pool.evictable_pages(),
            tokens_per_page=self.layout.tokens_per_page,
            steps=self.counters.steps,
            prefetch_hits=stats.prefetch_hits,
            prefetch_misses=stats.misses + stats.prefetch_late,
            waste_fraction=pool.waste_fraction,
            instance=f"sim-{self.worker_id}",
            step_samples=self.step_samples,
        )
        self.finished, self.step_samples, self.last_report = [], [], now
        return report


# ---- the simulation --------------------------------------------------------------------------------
@dataclass
class Outcome:
    request: SimRequest
    slo_s: float
    status: str = "unfinished"  # ok | refused (at add) | failed (a Fail decision) | unfinished (cut at the end)
    reason: str = ""
    assigned_s: float | None = None  # when its first ASSIGN reached a worker
    first_token_s: float | None = None
    finished_s: float | None = None
    worker: str = ""
    migrations: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.request.arrival_s

    @property
    def queued_s(self) -> float | None:
        """Arrival to its worker: the scheduler's queue and the message."""
        return None if self.assigned_s is None else self.assigned_s - self.request.arrival_s


@dataclass
class SimResult:
    outcomes: list[Outcome]
    workers: dict[str, dict]  # worker id -> counters and adapter load stats
    end_s: float
    events: int
    decisions: dict[str, int] = field(default_factory=dict)  # the policy's decisions, by type
    worker_gone: list[str] = field(default_factory=list)


class Simulation:
    def __init__(
        self,
        trace: SimTrace,
        policy,
        config: SimConfig,
        costs: CostModel,
        model: ModelConfig,
        slo_of: Callable[[SimRequest], float],
    ):
        self.trace, self.policy, self.config, self.costs = trace, policy, config, costs
        self.workers = {
            f"worker-{i}": SimWorker(f"worker-{i}", config, model, costs, trace.adapters) for i in range(config.workers)
        }
        self.outcomes = {r.request_id: Outcome(r, slo_of(r)) for r in trace.requests}
        self.open = len(self.outcomes)  # requests not yet in a final state
        self._events: list = []
        self._seq = itertools.count()
        self.now = 0.0
        self.gone: list[str] = []
        self.decisions: Counter[str] = Counter()

    def _at(self, t: float, kind: str, data=None) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, data))

    def run(self) -> SimResult:
        for worker in self.workers.values():  # registration: ready at 0
            self._execute(self.policy.on_report(worker.report(0.0), 0.0))
            self._at(self.config.report_interval_s, "heartbeat", worker)
        arrivals = iter(self.trace.requests)
        first = next(arrivals, None)
        if first is not None:
            self._at(first.arrival_s, "arrive", (first, arrivals))
        self._at(self.config.tick_s, "tick")
        last_arrival = self.trace.requests[-1].arrival_s if self.trace.requests else 0.0
        cutoff = last_arrival + self.config.drain_s
        handlers = {
            "arrive": self._arrive,
            "deliver": self._deliver,
            "resubmit": self._resubmit,
            "step_end": self._step_end,
            "report": self._report,
            "wake": self._wake,
            "heartbeat": self._heartbeat,
            "tick": self._tick,
        }
        events = 0
        while self._events and self.open > 0:
            t, _, kind, data = heapq.heappop(self._events)
            if t > cutoff:
                break
            self.now = t
            events += 1
            handlers[kind](data)
        workers = {wid: {**dataclasses.asdict(w.counters), **vars(w.pool.stats)} for wid, w in self.workers.items()}
        for wid, w in self.workers.items():
            workers[wid]["demand_copies"] = w.pool.demand_copies
        return SimResult(list(self.outcomes.values()), workers, self.now, events, dict(self.decisions), self.gone)

    # ---- events ---------------------------------------------------------------------------------
    def _arrive(self, data) -> None:
        request, rest = data
        following = next(rest, None)
        if following is not None:
            self._at(following.arrival_s, "arrive", (following, rest))
        outcome = self.outcomes[request.request_id]
        try:
            self.policy.add(self._queued(request, outcome.slo_s), self.now)
        except LoraserveError as e:
            self._close(outcome, "refused", f"{e.status}: {e}")
            return
        self._round()

    def _queued(self, r: SimRequest, slo_s: float, attempt: int = 0) -> QueuedRequest:
        optional = {
            "tenant": r.tenant,
            "ttft_slo_s": slo_s,
            "rank": self.trace.adapters.get(r.adapter, 0) if r.adapter else 0,
            "attempt": attempt,
        }
        return QueuedRequest(
            request_id=r.request_id,
            adapter=(r.adapter, 1) if r.adapter else None,
            prompt_len=r.prompt_len,
            max_new_tokens=r.output_len,
            reply_to="sim",
            arrival=r.arrival_s,
            payload=r,
            **optional,
        )

    def _deliver(self, data) -> None:
        worker, decision = data
        if isinstance(decision, AssignTo):
            outcome = self.outcomes[decision.request.request_id]
            outcome.worker = worker.worker_id
            if outcome.assigned_s is None:
                outcome.assigned_s = self.now
        worker.inbox.append(decision)
        self._begin(worker)

    def _resubmit(self, queued: QueuedRequest) -> None:
        """A migrated request comes back from its gateway: attempt + 1, queued at the head."""
        outcome = self.outcomes[queued.request_id]
        if outcome.status != "unfinished":
            return
        try:
            self.policy.add(self._queued(queued.payload, outcome.slo_s, queued.attempt + 1), self.now, resumed=True)
        except LoraserveError as e:
            self._close(outcome, "failed", f"{e.status}: {e}")
            return
        self._round()

    def _begin(self, worker: SimWorker) -> None:
        if worker.busy:
            return
        end = worker.begin(self.now)
        if end is not None:
            self._at(end, "step_end", worker)
            return
        wake = worker.next_wake()
        if wake is not None:
            self._at(max(wake, self.now), "wake", worker)

    def _step_end(self, worker: SimWorker) -> None:
        for request_id, what in worker.end(self.now):
            outcome = self.outcomes[request_id]
            if what == "first" and outcome.first_token_s is None:
                outcome.first_token_s = self.now
            elif what == "done":
                outcome.finished_s = self.now
                self._close(outcome, "ok")
        self._at(self.now + self.config.link_s, "report", worker.report(self.now))
        self._begin(worker)

    def _report(self, report: WorkerReport) -> None:
        self._execute(self.policy.on_report(report, self.now))
        self._round()

    def _wake(self, worker: SimWorker) -> None:
        self._begin(worker)

    def _heartbeat(self, worker: SimWorker) -> None:
        if not worker.busy and self.now - worker.last_report >= self.config.report_interval_s - 1e-9:
            self._at(self.now + self.config.link_s, "report", worker.report(self.now))
        self._at(self.now + self.config.report_interval_s, "heartbeat", worker)

    def _tick(self, _) -> None:
        self._round()
        self._at(self.now + self.config.tick_s, "tick")

    # ---- the loop's side of the policy ------------------------------------------------------------
    def _round(self) -> None:
        self._execute(self.policy.schedule(self.now))

    def _execute(self, decisions) -> None:
        later = self.now + self.config.link_s
        for d in decisions:
            self.decisions[type(d).__name__] += 1
            if isinstance(d, AssignTo | PrefetchOn | CancelOn):
                self._at(later, "deliver", (self.workers[d.worker_id], d))
            elif isinstance(d, Migrate):
                self.outcomes[d.request.request_id].migrations += 1
                cancel = CancelOn(d.worker_id, (d.request.request_id,), d.reason)
                self._at(later, "deliver", (self.workers[d.worker_id], cancel))
                self._at(later + 2 * self.config.link_s, "resubmit", d.request)  # scheduler -> gateway -> scheduler
            elif isinstance(d, Fail):
                outcome = self.outcomes.get(d.request.request_id)
                if outcome is not None and outcome.status == "unfinished":
                    self._close(outcome, "failed", f"{d.status}: {d.message}")
            elif isinstance(d, WorkerGone):
                log.warning("simulated %s", d.reason)
                self.gone.append(d.reason)

    def _close(self, outcome: Outcome, status: str, reason: str = "") -> None:
        if outcome.status == "unfinished":
            outcome.status, outcome.reason = status, reason
            self.open -= 1
