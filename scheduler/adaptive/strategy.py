"""The `adaptive` strategy: the scheduler's parts (`scheduler/`) composed over the policy's cluster view.

The multi-queue under VTC fairness (`queues.py`, `fairness.py`) orders the queue; a new request is
refused early when it cannot meet its TTFT target or deadline (`admission.py`) or its tenant floods a
nearly full queue; placement is by the step-cost model with adapter affinity (`placement.py`,
`cost_model.py`); requests move off overloaded workers (`migration.py`); prefetch hints are scored,
from the queue, adapter popularity and adapters likely to come back (`popularity.py`).

Each fresh worker's placement view (`placement.WorkerLoad`) is kept in a `LoadIndex` made once per
change of the fresh workers: a worker's entry is made again when the cluster view says it changed (a
report, a request that ended) or after LOAD_REFRESH_S, and kept true in place as requests are assigned
to it (the view that follows an assignment is the one the cluster view's change asked for). Prediction
and migration run at most every `predict_interval_s` / `migrate_interval_s`, and placement in a large
cluster costs only its likely winners, found from the index without a pass over the workers.
"""

from __future__ import annotations

import math
from collections.abc import Set as AbstractSet

from loraserve.errors import ResourceExhaustedError
from loraserve.scheduler.adaptive.planner import AdaptivePlanner
from loraserve.scheduler.admission import check_admission
from loraserve.scheduler.cluster import ClusterView, WorkerView
from loraserve.scheduler.config import AdaptiveConfig
from loraserve.scheduler.decisions import Decision, Migrate, PrefetchOn, QueuedRequest
from loraserve.scheduler.fairness import TenantRates, VirtualTokenCounter, flooder_cap
from loraserve.scheduler.load_index import LoadIndex
from loraserve.scheduler.placement import WorkerLoad
from loraserve.scheduler.queues import MultiQueue
from loraserve.wire import AdapterKey

LOAD_REFRESH_S = 0.25  # a worker's placement view is made again at least this often (workers report as often)
CAP_REFRESH_S = 0.005  # the flooding tenant's cap is found again at most this often


class AdaptiveStrategy:
    """The default strategy (module docstring), over the policy's cluster view."""

    name = "adaptive"
    tenant_fair = True  # VTC, the flooder cap, and the tenant batch share (`batch_share.py`)

    def __init__(self, config: AdaptiveConfig | None, cluster: ClusterView):
        self.config = config = config or AdaptiveConfig()
        self.cluster = cluster
        self.fairness = VirtualTokenCounter(config.vtc_input_weight, config.vtc_output_weight)
        self.queue = MultiQueue(config.size_classes, config.starvation_s, self.fairness)
        self.planner = AdaptivePlanner(config)  # cost model, placement, popularity, prefetch, migration
        self.rates = TenantRates()  # tenant -> arrivals per second: who floods the others
        self._index = LoadIndex([])  # the fresh workers' placement views, in `_of`'s order
        self._of: list[WorkerView] | None = None  # the fresh list `_index` was made for
        self._at: dict[str, tuple[int, float]] = {}  # worker -> (its position in `_index`, when its view was made)
        self._changed: set[str] = set()  # workers whose view must be made again
        self._refresh_at = -math.inf  # when the oldest view in `_index` may be older than LOAD_REFRESH_S
        self._sent: dict[str, tuple] = {}  # worker -> the hint it was last sent
        self._next_predict = self._next_migrate = -math.inf
        self._cap: tuple[float, tuple[str, int] | None] = (-math.inf, None)  # (when, `tenant_cap`)

    # ---- inputs --------------------------------------------------------------------------------
    def admit(self, request: QueuedRequest, now: float) -> int:
        """Queue a new request unless its tenant floods the queue or it cannot meet its target; returns
        about how many go first."""
        self.planner.arrived(request, now)
        self.rates.arrived(request.tenant, now)
        self._check_flood(request)
        ahead = self.queue.ahead(request, now)
        if request.ttft_slo_s is not None or request.deadline is not None:
            estimate = self.planner.estimate(self.loads(now), request, ahead)
            check_admission(estimate, now, request.arrival, request.ttft_slo_s, request.deadline)
        self.queue.push(request)
        return ahead

    def _check_flood(self, request: QueuedRequest) -> None:
        limit = self.config.max_queue_length
        if len(self.queue) < 0.75 * limit or self.fairness.known_tenants() < 2:
            return
        if self.queue.count(request.tenant) >= self.config.flood_share * len(self.queue):
            raise ResourceExhaustedError(
                f"tenant {request.tenant!r} holds {self.queue.count(request.tenant)} of the "
                f"{len(self.queue)} queued requests (the queue takes {limit}); retry later"
            )

    def observe(self, view: WorkerView, finished: list[QueuedRequest], now: float) -> None:
        self.planner.observe(view.report)
        for request in finished:
            self.planner.ended(request, now)

    def worker_changed(self, worker_id: str) -> None:
        self._changed.add(worker_id)
        if worker_id not in self.cluster.workers:
            self._sent.pop(worker_id, None)
            self.planner.forget_worker(worker_id)

    # ---- views ---------------------------------------------------------------------------------
    def loads(self, now: float) -> list[WorkerLoad]:
        """The fresh workers as placement sees them; only the changed ones (and those older than
        LOAD_REFRESH_S: what is loading or cached there expires) are made again."""
        fresh = self.cluster.fresh(now)
        if fresh is not self._of:
            self._of, self._changed = fresh, set()
            self._index = LoadIndex([self._make(view, now) for view in fresh])
            self._at = {view.worker_id: (i, now) for i, view in enumerate(fresh)}
            self._refresh_at = now + LOAD_REFRESH_S
            return self._index.loads
        for worker_id in self._changed:
            at = self._at.get(worker_id)
            if at is not None:
                self._remake(at[0], now)
        self._changed.clear()
        if now >= self._refresh_at or now < self._refresh_at - 2 * LOAD_REFRESH_S:
            for i, view in enumerate(fresh):
                if not 0 <= now - self._at[view.worker_id][1] <= LOAD_REFRESH_S:
                    self._remake(i, now)
            self._refresh_at = min((made for _, made in self._at.values()), default=now) + LOAD_REFRESH_S
        return self._index.loads

    def _make(self, view: WorkerView, now: float) -> WorkerLoad:
        return self.planner.load_of(view, self.cluster.request, now)

    def _remake(self, i: int, now: float) -> None:
        assert self._of is not None
        view = self._of[i]
        self._index.set(i, self._make(view, now))
        self._at[view.worker_id] = (i, now)

    def load_of(self, view: WorkerView, now: float) -> WorkerLoad:
        """One worker's placement view (a fresh one's from the list)."""
        loads, at = self.loads(now), self._at.get(view.worker_id)
        if at is not None and self._of is not None and self._of[at[0]] is view:
            return loads[at[0]]
        return self._make(view, now)

    # ---- placement -----------------------------------------------------------------------------
    def choose(self, request: QueuedRequest, now: float, excluded: AbstractSet[str] = frozenset()) -> WorkerView | None:
        """The cheapest fresh worker with room (none of `excluded`)."""
        self.loads(now)
        chosen = self._index.choose(self.planner.placement, self.planner.demand(request), excluded=excluded)
        return self.cluster.workers[chosen.worker_id] if chosen is not None else None

    def fits(self, view: WorkerView, request: QueuedRequest, now: float) -> bool:
        return self.planner.placement.fits(self.load_of(view, now), self.planner.demand(request))

    def hold(self, request: QueuedRequest, view: WorkerView, now: float) -> bool:
        """Keep a new request queued up to `prefetch_hold_s` (and a share of its TTFT target) while its
        chosen worker, busy with others, prefetches its adapter in the background (the hint goes out
        this round), so that no step of that batch waits for the adapter's copy. An idle worker is not
        held for: nobody waits there. 0 turns it off."""
        until = request.enqueued + self.config.prefetch_hold_s
        if request.ttft_slo_s is not None:  # spend at most a share of the TTFT target waiting
            until = min(until, request.arrival + self.config.hold_slo_share * request.ttft_slo_s)
        return (
            request.adapter is not None
            and request.attempt == 0
            and now < until
            and request.adapter not in view.resident
            and view.held > 0
        )

    def tenant_cap(self, now: float) -> tuple[str, int] | None:
        """The flooding tenant with the most slots it may hold (`fairness.flooder_cap`), if any; made at
        most every CAP_REFRESH_S (it asks every tenant's rate), as backlogs and rates change slowly."""
        if 0 <= now - self._cap[0] < CAP_REFRESH_S:
            return self._cap[1]
        in_flight = self.cluster.in_flight
        share = self.config.flooder_slot_share
        cap = flooder_cap(
            in_flight, self.queue.backlogs(), self.cluster.slots(now), share, lambda t: self.rates.rate(t, now)
        )
        self._cap = now, cap
        return cap

    def assigned(self, view: WorkerView, request: QueuedRequest, now: float) -> None:
        """Keep the worker's placement view true without making it again."""
        self.queue.taken(request)
        at = self._at.get(view.worker_id)
        self._changed.discard(view.worker_id)  # the cluster view said so; the update below is enough
        if at is not None and self._of is not None and self._of[at[0]] is view:
            self._index.set(at[0], self.planner.with_request(self._index.loads[at[0]], request))
        if request.adapter is not None:
            self.planner.loading(view.worker_id, request.adapter, now)
        if request.prefix is not None:
            self.planner.caching(view.worker_id, request.prefix, view.report.tokens_per_page, now)

    def hinted(self, view: WorkerView, adapter: AdapterKey, now: float) -> bool:
        """Whether to hint `adapter` to `view` (not if it is loading it already); it counts as loading it."""
        if adapter in self.load_of(view, now).adapters:
            return False
        self.planner.loading(view.worker_id, adapter, now)
        self._changed.add(view.worker_id)
        return True

    # ---- migration and prediction --------------------------------------------------------------
    def plan(self, now: float, held: bool) -> list[Decision]:
        """Migrations and prefetch hints, each at most every its interval (their work grows with the
        cluster, not with a round); hints at once when a request was held for its prefetch (`held`)."""
        config, decisions = self.config, []
        if now >= self._next_migrate or now < self._next_migrate - config.migrate_interval_s:
            self._next_migrate = now + config.migrate_interval_s
            decisions += self._migrate(now)
        due = now >= self._next_predict or now < self._next_predict - config.predict_interval_s
        if due or held:
            self._next_predict = now + config.predict_interval_s
            decisions += self._predict(now)
        return decisions

    def _migrate(self, now: float) -> list[Decision]:
        """Requests that move off overloaded workers (`migration.py`). Only waiting requests start a move, and
        a running one moves only off a worker where one has waited `migrate_after_s`: the running requests
        of the other workers are not looked at."""
        if not self.config.migrate_after_s:
            return []
        placed, after_s = self.cluster.placed, self.config.migrate_after_s
        waiting, stuck = [], []
        for view in self.cluster.fresh(now):
            for request_id in view.report.waiting:
                entry = placed.get(request_id)
                if entry is not None and entry[1] is not None and entry[1].attempt == 0 and entry[0] == view.worker_id:
                    waiting.append((view.worker_id, entry[1]))
                    if now - entry[1].placed_at >= after_s and (not stuck or stuck[-1] is not view):
                        stuck.append(view)
        if not waiting:
            return []
        running = []
        for view in stuck:
            for request_id in view.report.running:
                entry = placed.get(request_id)
                if entry is not None and entry[1] is not None and entry[1].attempt == 0 and entry[0] == view.worker_id:
                    running.append((view.worker_id, entry[1]))
        loads = self.loads(now)
        decisions: list[Decision] = []
        for move in self.planner.migrations(loads, waiting, running, now):
            _, request = self.cluster.unplace(move.request_id)
            assert request is not None
            reason = f"migrated from overloaded worker {move.source} to idle worker {move.target}"
            decisions.append(Migrate(move.source, request, reason))
        return decisions

    def _predict(self, now: float) -> list[Decision]:
        """Scored hints, each only to the worker that would serve it (`popularity.py`)."""
        workers, loads = self.cluster.fresh(now), self.loads(now)
        upcoming = self.queue.upcoming(now, self.config.prefetch_depth)
        placement = self.planner.placement
        plan = self.planner.prefetch(loads, upcoming, now, lambda d, room: self._index.choose(placement, d, room))
        decisions: list[Decision] = []
        for view in workers:
            adapters, scores = plan.for_worker(view.worker_id)
            sent = (adapters, scores)
            if adapters and sent != self._sent.get(view.worker_id):
                decisions.append(PrefetchOn(view.worker_id, adapters, scores))
                for adapter in adapters:
                    self.planner.loading(view.worker_id, adapter, now)
                self._changed.add(view.worker_id)
            self._sent[view.worker_id] = sent
        return decisions
