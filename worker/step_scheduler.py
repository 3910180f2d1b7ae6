"""Iteration-level scheduling inside one worker: which requests run in the next step.

A pure object over the page pool's bookkeeping (no tensors, no I/O), so its policies are tested
directly. Each `schedule()`:

1. Running requests, oldest first, get their next tokens (1 when decoding, a chunk of the prompt
   when prefilling) within the step's token budget. If the pool has no page for a request's new
   KV, unused adapters are evicted (LRU); if that is not enough, the newest running request is
   preempted: its KV is freed and it goes back to the front of the queue, to be recomputed later.
2. Waiting requests, first come first served, join while there is batch room, token budget and
   pool room (their adapter's pages plus KV for their first chunk). A request never preempts
   others to get in, and the queue's head is not overtaken.

The scheduled requests are ordered so that requests of one adapter are consecutive (Punica's
segments); the plan lists adapters given pages this step, whose rows must be copied in before
the forward pass.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loraserve.worker.page_pool import PagePool
from loraserve.worker.request import AdapterKey, FinishReason, Request, Status


@dataclass
class StepPlan:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens this step)
    adapter_loads: list[AdapterKey] = field(default_factory=list)
    evicted: list[AdapterKey] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


# (pages, useful elements) an adapter takes in the pool
Footprint = Callable[[AdapterKey], tuple[int, int]]


class StepScheduler:
    def __init__(self, pool: PagePool, footprint: Footprint, max_batch_size: int, max_batched_tokens: int):
        self.pool = pool
        self.footprint = footprint
        self.max_batch_size = max_batch_size
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order

    # ---- queue ---------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """Release everything `request` holds (KV pages, adapter pin) and mark it finished."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.status, request.finish_reason, request.error = Status.FINISHED, reason, error

    def _release(self, request: Request) -> None:
        self.pool.free_kv(request.request_id)
        if request.adapter is not None:
            self.pool.unpin(request.adapter)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        self._release(request)
        request.status, request.num_computed = Status.WAITING, 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        plan.preempted.append(request)

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_batched_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(request.num_tokens - request.num_computed, budget)
            if not self._room_for_running(request, n, plan):
                continue  # it preempted itself
            plan.scheduled.append((request, n))
            budget -= n
        if not plan.preempted:  # after a preemption the pool is tight: let the running batch drain first
            self._admit(plan, budget)
        plan.scheduled.sort(key=lambda item: (item[0].adapter is None, item[0].adapter or ("", 0)))
        return plan

    def _room_for_running(self, request: Request, n: int, plan: StepPlan) -> bool:
        target = request.num_computed + n
        while not self.pool.grow_kv(request.request_id, target):
            need = self.pool.kv_pages_to_grow(request.request_id, target)
            evicted = self.pool.evict_for(need, for_kv=True)
            if evicted is not None:
                plan.evicted.extend(evicted)
                continue
            victim = self.running[-1]
            if victim is request:
                self._preempt(request, plan)
                return False
            self._preempt(victim, plan)
            plan.scheduled = [(r, k) for r, k in plan.scheduled if r is not victim]
        return True

    def _admit(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            keep = frozenset(r.adapter for r in self.running if r.adapter is not None)
            if request.adapter is not None and not self._adapter_room(request.adapter, keep, plan):
                return
            n = min(request.num_tokens - request.num_computed, budget)
            target = request.num_computed + n
            need = self.pool.kv_pages_to_grow(request.request_id, target)
            keep_with_own = keep | ({request.adapter} if request.adapter else set())
            evicted = self.pool.evict_for(need, keep=frozenset(keep_with_own), for_kv=True)
            if evicted is None or not self.pool.grow_kv(request.request_id, target):
                return
            plan.evicted.extend(evicted)
            self.waiting.popleft()
            if request.adapter is not None:
                self.pool.pin(request.adapter)
            request.status = Status.RUNNING
            self.running.append(request)
            plan.scheduled.append((request, n))
            budget -= n

    def _adapter_room(self, key: AdapterKey, keep: frozenset, plan: StepPlan) -> bool:
        """Make `key` resident (pages only; the engine copies the data). False if it cannot fit now."""
        if self.pool.is_resident(key):
            return True
        pages, useful = self.footprint(key)
        evicted = self.pool.evict_for(pages, keep=keep)
        if evicted is None:
            return False
        plan.evicted.extend(evicted)
        self.pool.allocate_adapter(key, pages, useful)
        plan.adapter_loads.append(key)
        return True

    # ---- prefetch ------------------------------------------------------------------------------
    def plan_prefetch(self, keys: list[AdapterKey], reserve_pages: int) -> tuple[list[AdapterKey], list[AdapterKey]]:
        """Give pages to predicted adapters that are not resident, most urgent first.

        A predicted adapter is worth more than an idle cached one, so idle adapters that are not
        predicted may be evicted (LRU first) to make room; pinned ones never are, and
        `reserve_pages` stay free for KV growth. Returns (adapters given pages, whose data the
        engine then copies in the background; adapters evicted for them).
        """
        wanted = frozenset(keys)
        started: list[AdapterKey] = []
        evicted: list[AdapterKey] = []
        for key in dict.fromkeys(keys):
            if self.pool.is_resident(key):
                continue
            pages, useful = self.footprint(key)
            made_room = self.pool.evict_for(pages + reserve_pages, keep=wanted)
            if made_room is None:
                break
            evicted += made_room
            self.pool.allocate_adapter(key, pages, useful)
            started.append(key)
        return started, evicted
