"""The `fcfs` strategy: first come, first served, on the least-loaded worker with room.

The request at the head of the queue goes to the *least-loaded* fresh worker (fewest requests held)
that still has batch room and pool room for the request's whole KV (prompt + max new tokens), as a
load-balancing router places work; among equally loaded ones, one holding the request's adapter, then
the smallest id. Nobody overtakes the head. Prediction (S-LoRA §5.2): the adapters of the next
`prefetch_depth` queued requests are what workers will need next; each ready worker that lacks one
of them is told to prefetch it, and told again only when what it lacks changes.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from loraserve.scheduler.cluster import ClusterView, WorkerView
from loraserve.scheduler.config import FcfsConfig
from loraserve.scheduler.decisions import Decision, PrefetchOn, QueuedRequest
from loraserve.scheduler.queues import FifoQueue
from loraserve.wire import AdapterKey


class FcfsStrategy:
    """The baseline strategy (module docstring), over the policy's cluster view."""

    name = "fcfs"
    tenant_fair = False  # no fairness between tenants: no tenant batch share either (`batch_share.py`)

    def __init__(self, config: FcfsConfig | None, cluster: ClusterView):
        self.config = config or FcfsConfig()
        self.cluster = cluster
        self.queue = FifoQueue()
        self._sent: dict[str, tuple[AdapterKey, ...]] = {}  # worker -> adapters it was last told it lacks
        self._wanted: tuple[AdapterKey, ...] = ()
        self._ready: list[WorkerView] | None = None  # the ready list `_wanted` was last sent against
        self._changed: set[str] = set()  # workers changed since the last prediction

    # ---- inputs --------------------------------------------------------------------------------
    def admit(self, request: QueuedRequest, now: float) -> int:
        self.queue.push(request)
        return len(self.queue) - 1

    def observe(self, view: WorkerView, finished: list[QueuedRequest], now: float) -> None:
        pass

    def worker_changed(self, worker_id: str) -> None:
        self._changed.add(worker_id)
        if worker_id not in self.cluster.workers:
            self._sent.pop(worker_id, None)

    # ---- placement -----------------------------------------------------------------------------
    def choose(self, request: QueuedRequest, now: float, excluded: AbstractSet[str] = frozenset()) -> WorkerView | None:
        """The least-loaded fresh worker with batch and pool room, then one holding the adapter, then the
        smallest id (none of `excluded`)."""
        adapter = request.adapter
        best, best_key = None, None
        for w in self.cluster.fresh(now):
            if not w.has_room(request) or w.worker_id in excluded:
                continue
            key = (w.held, not (adapter is not None and adapter in w.resident), w.worker_id)
            if best_key is None or key < best_key:
                best, best_key = w, key
        return best

    def fits(self, view: WorkerView, request: QueuedRequest, now: float) -> bool:
        return view.has_room(request)

    def hold(self, request: QueuedRequest, view: WorkerView, now: float) -> bool:
        return False  # nobody waits for a prefetch

    def tenant_cap(self, now: float) -> tuple[str, int] | None:
        return None  # no fairness between tenants

    def assigned(self, view: WorkerView, request: QueuedRequest, now: float) -> None:
        pass

    def hinted(self, view: WorkerView, adapter: AdapterKey, now: float) -> bool:
        return True  # a hint goes wherever placement would go, if it lacks the adapter

    # ---- prediction ----------------------------------------------------------------------------
    def plan(self, now: float, held: bool) -> list[Decision]:
        """The adapters of the next queued requests, to every ready worker that lacks them. Only the
        workers that changed are looked at again while the wanted adapters and the ready list stay."""
        wanted = tuple(
            dict.fromkeys(r.adapter for r in self.queue.upcoming(now, self.config.prefetch_depth) if r.adapter)
        )
        ready = self.cluster.ready()
        if wanted == self._wanted and ready is self._ready:
            if not self._changed:
                return []
            views = [v for v in ready if v.worker_id in self._changed]
        else:
            views = ready
        self._wanted, self._ready = wanted, ready
        self._changed.clear()
        decisions: list[Decision] = []
        for view in views:
            missing = tuple(k for k in wanted if k not in view.resident)
            if missing and missing != self._sent.get(view.worker_id):
                decisions.append(PrefetchOn(view.worker_id, missing))
            self._sent[view.worker_id] = missing
        return decisions
