"""The `adaptive` strategy's planning state, apart from the queue: the step-cost model, placement,
adapter popularity and what each worker is loading. `AdaptiveStrategy` asks it; it holds no
request state of its own (the strategy owns the queue, the cluster view the workers and the placed
requests).

    observe(report)                 measured steps refit the cost model
    load_of(view, ...)              a worker as placement sees it (`placement.WorkerLoad`)
    estimate(loads, request, ahead) what admission needs (`admission.ClusterEstimate`)
    migrations(loads, waiting, now) which waiting requests move (`migration.py`)
    prefetch(loads, ...)            scored hints per worker (`popularity.py`): the queue, popularity, returns
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import TYPE_CHECKING, Generic, TypeVar

from loraserve.prefix_keys import PrefixProbe
from loraserve.scheduler.admission import ClusterEstimate
from loraserve.scheduler.cost_model import BatchShape, StepCostModel
from loraserve.scheduler.migration import Move, RunningRequest, WaitingRequest, plan_migrations
from loraserve.scheduler.placement import Demand, Placement, WorkerLoad
from loraserve.scheduler.popularity import AdapterPopularity, PrefetchPlan, ReturningAdapters, plan_prefetch
from loraserve.wire import AdapterKey, WorkerReport

if TYPE_CHECKING:
    from loraserve.scheduler.cluster import WorkerView
    from loraserve.scheduler.config import AdaptiveConfig
    from loraserve.scheduler.decisions import QueuedRequest

T = TypeVar("T")
LOADING_S = 2.0  # an adapter hinted to or needed on a worker counts as "being loaded" there this long,
# or until the worker reports it resident (from then on its reports say whether it still is)
REPLICATE_SCORE = 0.9  # a popular adapter this likely to be asked for on each worker goes to all
TYPICAL_PROMPT = 128  # tokens of the request a popular adapter is prefetched for (placement's what-if)
RETURNING = 8  # returning adapters (the most recently ended) looked at in a prediction

Lookup = Callable[[str], "QueuedRequest | None"]  # request id -> the placed request, if this scheduler placed it
Choose = Callable[[Demand, bool], "WorkerLoad | None"]  # (demand, need room) -> where placement puts it


class AdaptivePlanner:
    """The cost model, placement, popularity and what each worker is loading or caching (module docstring)."""

    def __init__(self, config: AdaptiveConfig):
        self.config = config
        self.cost = StepCostModel(config.step_cost)
        self.placement = Placement(self.cost, config.adapter_load_s)
        self.popularity = AdapterPopularity(config.popularity_half_life_s)
        self.returns = ReturningAdapters(config.return_window_s)
        self._loading: dict[str, dict[AdapterKey, float]] = {}  # worker -> adapter -> since
        self._caching: dict[str, dict[bytes, float]] = {}  # worker -> prefix fingerprint placed there -> since

    # ---- inputs --------------------------------------------------------------------------------
    def observe(self, report: WorkerReport) -> None:
        for tokens, rank_tokens, adapters, kv_pages, seconds in report.step_samples:
            self.cost.observe(BatchShape(tokens, rank_tokens, adapters, kv_pages), seconds)

    def arrived(self, request: QueuedRequest, now: float) -> None:
        """A new request (not a resumed one): its adapter's popularity, and whether it returned."""
        if request.adapter is not None:
            self.popularity.arrived(request.adapter, now)
            self.returns.arrived(request.adapter, now)

    def ended(self, request: QueuedRequest, now: float) -> None:
        if request.adapter is not None:
            self.returns.ended(request.adapter, self.rank(request), now)

    def loading(self, worker_id: str, adapter: AdapterKey, now: float) -> None:
        self._loading.setdefault(worker_id, {})[adapter] = now

    def caching(self, worker_id: str, prefix: PrefixProbe, tokens_per_page: int, now: float) -> None:
        """A request with this prefix was placed on the worker: its prefix counts as cached there for
        LOADING_S, or until a report of the worker's cached prefixes says otherwise."""
        coming = self._caching.setdefault(worker_id, {})
        for _, fingerprint in prefix.fingerprints(tokens_per_page):
            coming[fingerprint] = now

    def forget_worker(self, worker_id: str) -> None:
        self._loading.pop(worker_id, None)
        self._caching.pop(worker_id, None)

    # ---- views ---------------------------------------------------------------------------------
    def rank(self, request: QueuedRequest) -> int:
        if request.adapter is None:
            return 0
        return request.rank or self.config.size_classes.default_rank

    def demand(self, request: QueuedRequest) -> Demand:
        return Demand(
            request.adapter,
            self.rank(request),
            request.prompt_len,
            request.max_new_tokens,
            self.config.output_fraction * request.max_new_tokens,
            request.prefix,
        )

    def load_of(self, view: WorkerView, placed: Lookup, now: float) -> WorkerLoad:
        report = view.report
        unreported = view.unreported()  # the report's sets are built once per report (WorkerView)
        known = [r for r in map(placed, (*view.reported, *unreported)) if r is not None]
        loading = self._loading.get(view.worker_id, {})
        resident = view.resident
        for adapter, since in list(loading.items()):
            if now - since > LOADING_S or adapter in resident:
                del loading[adapter]
        batch_adapters = frozenset(r.adapter for r in known if r.adapter is not None)
        coming = _unexpired(self._caching.setdefault(view.worker_id, {}), view.prefixes, now)
        return WorkerLoad(
            worker_id=view.worker_id,
            requests=view.held,  # kept by the cluster view as reports come and requests are placed
            waiting=view.held - len(view.running),
            max_batch=report.max_batch_size,
            room_pages=view.room_pages(),
            tokens_per_page=report.tokens_per_page,
            batch=BatchShape(
                tokens=view.held,
                rank_tokens=sum(self.rank(r) for r in known),
                adapters=len(batch_adapters),
                kv_pages=report.kv_pages + view.reserved_pages,
            ),
            adapters=resident.union(loading) if loading else resident,  # a set: placement asks it of many workers
            batch_adapters=batch_adapters,
            prefixes=_Union(view.prefixes, coming.keys()),  # live: what `caching` adds later counts at once
        )

    def with_request(self, load: WorkerLoad, request: QueuedRequest) -> WorkerLoad:
        """`load` once `request` is assigned there and not yet reported: what `load_of` would
        return after the assignment (and `loading` / `caching` of its adapter and prefix, which
        follow it), without going through the worker's requests again."""
        pages = -(-(request.prompt_len + request.max_new_tokens) // max(1, load.tokens_per_page))
        adapter = request.adapter
        new_segment = adapter is not None and adapter not in load.batch_adapters
        batch = load.batch
        return replace(
            load,
            requests=load.requests + 1,
            waiting=load.waiting + 1,
            room_pages=load.room_pages - pages,
            batch=replace(
                batch,
                tokens=batch.tokens + 1,
                rank_tokens=batch.rank_tokens + self.rank(request),
                adapters=batch.adapters + int(new_segment),
                kv_pages=batch.kv_pages + pages,
            ),
            adapters=load.adapters if adapter is None or adapter in load.adapters else load.adapters | {adapter},
            batch_adapters=load.batch_adapters | {adapter} if new_segment else load.batch_adapters,
        )

    # ---- decisions -----------------------------------------------------------------------------
    def estimate(self, loads: list[WorkerLoad], request: QueuedRequest, ahead: int) -> ClusterEstimate:
        d = self.demand(request)
        if not loads:
            return ClusterEstimate(ahead, 0, 0, 0.0, 0.0)
        slots = sum(w.max_batch for w in loads)
        free = sum(max(0, w.max_batch - w.requests) for w in loads)
        # a slot is held for the expected output's decode steps at a full batch's step time
        step = sum(self.cost.step_s(_full(w)) for w in loads) / len(loads)
        prefill = min(self.placement.cost.step_s(_with_prompt(w.batch, d)) for w in loads)
        return ClusterEstimate(ahead, slots, free, step * max(1.0, d.expected_output), prefill)

    def migrations(
        self,
        loads: list[WorkerLoad],
        waiting: list[tuple[str, QueuedRequest]],
        running: list[tuple[str, QueuedRequest]],
        now: float,
    ) -> list[Move]:
        items = [WaitingRequest(w, r.request_id, self.demand(r), r.placed_at) for w, r in waiting]
        step_s = {w.worker_id: self.cost.step_s(w.batch) for w in loads}
        moving = [
            RunningRequest(w, r.request_id, self.demand(r), r.prompt_len + self._generated(r, step_s.get(w), now))
            for w, r in running
        ]
        return plan_migrations(
            loads, items, now, self.config.migrate_after_s, self.placement, moving, self.config.max_recompute_tokens
        )

    @staticmethod
    def _generated(request: QueuedRequest, step_s: float | None, now: float) -> int:
        """Tokens a running request has probably generated: one per decode step since it was placed."""
        steps = (now - request.placed_at) / max(step_s or 0.0, 1e-3)
        return int(min(request.max_new_tokens, steps))

    def prefetch(
        self, loads: list[WorkerLoad], upcoming: list[QueuedRequest], now: float, choose: Choose | None = None
    ) -> PrefetchPlan:
        """Scored hints per worker; `choose(demand, need_room)` is placement over `loads` (by default
        `placement.choose`; the strategy passes its index's)."""
        choose = choose or (lambda d, need_room: self.placement.choose(loads, d, need_room))
        by_id = {w.worker_id: w for w in loads}
        queued = []
        for request in upcoming:
            if request.adapter is not None:  # where placement would put it now, or once room frees up
                demand = self.demand(request)
                target = choose(demand, True) or choose(demand, False)
                queued.append((request.adapter, target.worker_id if target is not None else None))
        popular = []
        horizon = self.config.prefetch_horizon_s
        for adapter, rate in self.popularity.most_popular(now, 8):
            likelihood = self.popularity.likelihood(adapter, now, horizon)
            per_worker = 1.0 - math.exp(-rate * horizon / max(1, len(loads)))  # its requests spread out
            if per_worker >= REPLICATE_SCORE:  # every worker will serve it: each that lacks it fetches it
                popular.append((adapter, per_worker, [w.worker_id for w in loads]))
            elif not any(adapter in w.adapters for w in loads):  # else the one placement would choose
                typical = Demand(
                    adapter, self.config.size_classes.default_rank, TYPICAL_PROMPT, TYPICAL_PROMPT, TYPICAL_PROMPT / 2
                )
                target = choose(typical, True)
                popular.append((adapter, likelihood, [target.worker_id] if target is not None else []))
        returning = self.returns.candidates(now, self.config.min_prefetch_score, RETURNING)
        for adapter, score, rank in returning:  # where its next request would go (affinity: where it is)
            target = choose(Demand(adapter, rank, TYPICAL_PROMPT, TYPICAL_PROMPT, TYPICAL_PROMPT / 2), True)
            popular.append((adapter, score, [target.worker_id] if target is not None else []))
        return plan_prefetch(
            queued, popular, holds=lambda w, a: a in by_id[w].adapters, min_score=self.config.min_prefetch_score
        )


class _Union(AbstractSet[T], Generic[T]):
    """A worker's reported set (resident adapters, cached prefixes) and what is on its way there (being
    loaded, placed there), as one set without copying either."""

    def __init__(self, resident: AbstractSet[T], loading: AbstractSet[T]):
        self._resident, self._loading = resident, loading

    def __contains__(self, key: object) -> bool:
        return key in self._resident or key in self._loading

    def __iter__(self) -> Iterator[T]:
        yield from self._resident
        yield from (k for k in self._loading if k not in self._resident)

    def __len__(self) -> int:
        return len(self._resident) + sum(1 for k in self._loading if k not in self._resident)

    def __bool__(self) -> bool:  # without counting: `if prefixes:` is asked for every worker of every placement
        return bool(self._resident) or bool(self._loading)


def _unexpired(coming: dict[bytes, float], reported: AbstractSet[bytes], now: float) -> dict[bytes, float]:
    """Drop from `coming` (fingerprint -> placed at) what is reported cached or older than LOADING_S."""
    for fingerprint, since in list(coming.items()):
        if now - since > LOADING_S or fingerprint in reported:
            del coming[fingerprint]
    return coming


def _full(w: WorkerLoad) -> BatchShape:
    """w's decode batch scaled up to its batch size: the step time while every slot is busy."""
    n = max(1, w.requests)
    scale = max(1, w.max_batch) / n
    b = w.batch
    return BatchShape(
        tokens=max(1, w.max_batch),
        rank_tokens=round(b.rank_tokens * scale),
        adapters=b.adapters,
        kv_pages=round(b.kv_pages * scale),
    )


def _with_prompt(batch: BatchShape, d: Demand) -> BatchShape:
    return BatchShape(
        tokens=batch.tokens + d.prompt_len,
        rank_tokens=batch.rank_tokens + d.rank * d.prompt_len,
        adapters=batch.adapters + int(d.adapter is not None),
        kv_pages=batch.kv_pages,
    )
