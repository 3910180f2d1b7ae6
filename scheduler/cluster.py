"""The cluster as the policy sees it: each worker's last report, which worker holds which request, dropped
workers, and adoption of requests a scheduler before this one placed. Pure: time is passed in.

    on_report(report, now)      -> (the worker's view or None, decisions, requests it finished)
    on_heartbeat(heartbeat, now) a registered worker is alive (its step has run `step_s`)
    place(view, request, now)   it was assigned there
    unplace(request_id)         it ended, failed or moved: (worker id, request) or None
    drop(view, reason)          -> decisions: the worker is gone, what it held fails over
    silent(now)                 -> decisions: workers dropped for sending nothing (no heartbeat, no report)
    listening(now, stall_s)     the loop runs (each round); a gap since its last run is no worker's silence
    ready() / fresh(now)        workers that take new requests / of those, the ones placed on now

Every question a decision asks is answered from state kept as reports and assignments come (a worker's
held requests and reserved pages, the ready and fresh lists, the slots and the largest pool), so a
decision costs neither a pass over the workers nor one over their requests. `on_change(worker_id)`
is called whenever anything about a worker changes, so a strategy can keep its own views incremental.

Two clocks per worker: `last_heard` (any message: its I/O thread heartbeats every 0.25 s whatever its step
does) says whether it is alive, and is what `worker_timeout_s` measures; `last_report` (reports come after
each step) says whether what it reported is recent enough to place on (`stale_after_s`). A worker in a long
step (its heartbeats say how long: `step_s`) is alive but not fresh: nothing new goes there until it reports.
At most `max_workers` are registered; a report from one more worker id is refused (`on_report` returns no view).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from loraserve.scheduler.batch_share import Holdings
from loraserve.scheduler.config import ClusterConfig
from loraserve.scheduler.decisions import CancelOn, Decision, Fail, QueuedRequest, WorkerGone
from loraserve.wire import AdapterKey, Heartbeat, WorkerReport

Placed = tuple[str, "QueuedRequest | None"]  # (worker id, request); None: adopted (placed by an earlier scheduler)
Reported = tuple["WorkerView | None", list[Decision], list[QueuedRequest]]  # `on_report`'s answer


def kv_pages(request: QueuedRequest, tokens_per_page: int) -> int:
    """KV pages the request's whole sequence (prompt + max new tokens) takes on a worker."""
    return -(-(request.prompt_len + request.max_new_tokens) // max(1, tokens_per_page))


@dataclass(eq=False)
class WorkerView:
    """A worker: its last report, sets derived from the report's lists (built only when the list they come
    from changed), and what it holds counting assignments it has not reported yet."""

    worker_id: str
    last_report: float
    report: WorkerReport
    assigned: set[str] = field(default_factory=set)  # request ids placed here (adopted ones included)
    resident: frozenset[AdapterKey] = field(init=False)  # report.resident, from the last report that carried it
    running: frozenset[str] = field(init=False)  # report.running
    reported: frozenset[str] = field(init=False)  # report.running + report.waiting
    prefixes: frozenset[bytes] = frozenset()  # report.cached_prefixes, from the last report that carried them
    held: int = 0  # requests held: reported running/waiting plus assignments not reported yet
    reserved_pages: int = 0  # KV pages that assignments not reported yet will take
    last_heard: float = field(init=False)  # when any message (report or heartbeat) last came from it
    step_s: float = 0.0  # how long its step under way has run, as its last heartbeat said (0 after a report)

    def __post_init__(self) -> None:
        self.last_heard = self.last_report
        self.resident = frozenset(map(tuple, self.report.resident or ()))  # type: ignore[arg-type]
        self.running = frozenset(self.report.running)
        self.reported = self.running | frozenset(self.report.waiting)
        self.prefixes = frozenset(self.report.prefixes())

    def update(self, report: WorkerReport, now: float) -> None:
        old, self.report, self.last_report = self.report, report, now
        self.last_heard, self.step_s = now, 0.0
        if report.cached_prefixes is not None:
            self.prefixes = frozenset(report.prefixes())
        if report.resident is not None:
            self.resident = frozenset(map(tuple, report.resident))  # type: ignore[arg-type]
        if report.running != old.running:
            self.running = frozenset(report.running)
        if report.running != old.running or report.waiting != old.waiting:
            self.reported = self.running | frozenset(report.waiting)

    def unreported(self) -> set[str]:
        """Assignments the worker has not reported yet."""
        return self.assigned - self.reported

    def room_pages(self) -> int:
        """Pool pages still free for KV, counting what unreported assignments will take."""
        return self.report.free_pages + self.report.evictable_pages - self.reserved_pages

    def has_room(self, request: QueuedRequest) -> bool:
        report = self.report
        return self.held < report.max_batch_size and kv_pages(request, report.tokens_per_page) <= self.room_pages()


class ClusterView:
    """Workers, the requests placed on them, and the dropped workers still recognised (module docstring)."""

    def __init__(self, config: ClusterConfig | None = None, on_change: Callable[[str], None] | None = None):
        self.config = config or ClusterConfig()
        self.on_change = on_change or (lambda worker_id: None)
        self.workers: dict[str, WorkerView] = {}
        self.placed: dict[str, Placed] = {}
        self.holdings = Holdings()  # per worker: the requests placed there by client request and by tenant
        self.in_flight = self.holdings.tenants  # tenant -> requests it holds on workers (placed by us)
        self._zombies: OrderedDict[str, str] = OrderedDict()  # dropped worker -> its instance
        self._ready: list[WorkerView] | None = None
        self._max_tokens = 0  # the most tokens one request may take on some ready worker's pool
        self._fresh: list[WorkerView] = []
        self._fresh_ids: frozenset[str] = frozenset()  # the fresh list's workers, to ask about one in O(1)
        self._fresh_until = -1.0  # the fresh list holds until then (or a change of the ready list)
        self._fresh_at = 0.0  # when it was made (a clock that goes back makes it again)
        self._slots = 0  # batch slots of the fresh workers
        self._oldest = float("inf")  # a bound on the oldest last report: no worker timed out before it
        self._listened: float | None = None  # when the scheduler's loop last ran (`listening`)

    # ---- questions ---------------------------------------------------------------------------------
    def ready(self) -> list[WorkerView]:
        """Workers that take new requests: warmed up and not draining."""
        if self._ready is None:
            self._ready = [w for w in self.workers.values() if w.report.ready and not w.report.draining]
            pools = (w.report.total_pages * max(1, w.report.tokens_per_page) for w in self._ready)
            self._max_tokens = max(pools, default=0)
            self._fresh_until = -1.0
        return self._ready

    def fits_ever(self, request: QueuedRequest) -> bool:
        """Whether some ready worker's whole pool could hold the request."""
        self.ready()
        return request.prompt_len + request.max_new_tokens <= self._max_tokens

    def fresh(self, now: float) -> list[WorkerView]:
        """Ready workers whose last report is recent enough to place on, and whose step under way (as its
        heartbeats say) is not longer than that. The list is looked at again only when the ready list
        changes, its oldest member may have gone stale, or a heartbeat says a member's step got long; it
        is a new list only when its members changed."""
        ready = self.ready()
        if now > self._fresh_until or now < self._fresh_at:
            fresh_s = self.config.fresh_s
            fresh = [w for w in ready if now - w.last_report <= fresh_s and w.step_s <= fresh_s]
            if fresh != self._fresh:  # the same workers: the same list, so views made for it stay
                self._fresh = fresh
                self._fresh_ids = frozenset(w.worker_id for w in fresh)
            self._fresh_at = now
            self._fresh_until = min((w.last_report for w in self._fresh), default=now) + fresh_s
            self._slots = sum(w.report.max_batch_size for w in self._fresh)
        return self._fresh

    def is_fresh(self, view: WorkerView, now: float) -> bool:
        self.fresh(now)
        return view.worker_id in self._fresh_ids

    def slots(self, now: float) -> int:
        """Batch slots of the fresh workers."""
        self.fresh(now)
        return self._slots

    def request(self, request_id: str) -> QueuedRequest | None:
        """The placed request, if this scheduler placed it."""
        placed = self.placed.get(request_id)
        return placed[1] if placed is not None else None

    # ---- changes -----------------------------------------------------------------------------------
    def on_report(self, report: WorkerReport, now: float) -> Reported:
        """A worker's report: registers it (adopting what it holds) or updates it. Returns its view (None:
        a zombie told to cancel, or one that stopped), decisions, and the requests placed here it finished."""
        view = self.workers.get(report.worker_id)
        decisions: list[Decision] = []
        if view is not None and report.instance != view.report.instance:
            decisions += self.drop(view, f"worker {report.worker_id} restarted")
            view = None
        if view is None:
            if self._zombies.get(report.worker_id) == report.instance:  # back from the dead
                held = (*report.running, *report.waiting)
                if held:  # what it holds was failed over already
                    return None, [*decisions, CancelOn(report.worker_id, held, "this worker was dropped")], []
                if report.fatal:
                    return None, decisions, []
            if len(self.workers) >= self.config.max_workers:  # refused: its requests, if any, are not adopted
                return None, decisions, []
            self._zombies.pop(report.worker_id, None)
            view = self.workers[report.worker_id] = WorkerView(report.worker_id, now, report)
            for request_id in (*report.running, *report.waiting):  # adopted (this scheduler restarted)
                if request_id not in self.placed:
                    view.assigned.add(request_id)
                    self.placed[request_id] = (report.worker_id, None)
            self._ready = None
            self._oldest = min(self._oldest, now)
        old = view.report
        view.update(report, now)
        if (report.ready, report.draining, report.total_pages, report.tokens_per_page) != (
            old.ready,
            old.draining,
            old.total_pages,
            old.tokens_per_page,
        ):
            self._ready = None
        elif report.max_batch_size != old.max_batch_size or view.worker_id not in self._fresh_ids:
            self._fresh_until = -1.0  # a stale worker came back, or its slots changed
        finished = []
        for request_id in report.finished:
            view.assigned.discard(request_id)
            placed = self._forget(request_id)
            if placed is not None and placed[1] is not None:
                finished.append(placed[1])
        self._count(view)
        return view, decisions, finished

    def on_heartbeat(self, heartbeat: Heartbeat, now: float) -> bool:
        """A heartbeat: a registered worker (this process of it) is alive, its step under way has run
        `step_s`. False (nothing changed) for a worker that is not registered, or another process under
        its id: only a report registers, or replaces, a worker."""
        view = self.workers.get(heartbeat.worker_id)
        if view is None or heartbeat.instance != view.report.instance:
            return False
        view.last_heard = now
        fresh_s = self.config.fresh_s
        if heartbeat.step_s > fresh_s >= view.step_s and view.worker_id in self._fresh_ids:
            self._fresh_until = -1.0  # its step got long: look at the fresh list again
        view.step_s = heartbeat.step_s
        return True

    def place(self, view: WorkerView, request: QueuedRequest, now: float) -> None:
        request.placed_at = now
        view.assigned.add(request.request_id)
        self.placed[request.request_id] = (view.worker_id, request)
        self.holdings.add(view.worker_id, request)
        view.held += 1
        view.reserved_pages += kv_pages(request, view.report.tokens_per_page)
        self.on_change(view.worker_id)

    def unplace(self, request_id: str) -> Placed | None:
        """Forget where `request_id` was placed (it ended, failed or moved), and its worker's assignment of it."""
        placed = self._forget(request_id)
        view = self.workers.get(placed[0]) if placed is not None else None
        if view is not None:
            view.assigned.discard(request_id)
            self._count(view)
        return placed

    def drop(self, view: WorkerView, reason: str) -> list[Decision]:
        """The worker is gone: forget it (remembering its instance), and fail over what it held."""
        del self.workers[view.worker_id]
        self._ready = None
        self.on_change(view.worker_id)
        self._zombies[view.worker_id] = view.report.instance
        while len(self._zombies) > self.config.max_zombies:
            self._zombies.popitem(last=False)
        decisions: list[Decision] = [WorkerGone(view.worker_id, reason)]
        for request_id in sorted(view.assigned):
            placed = self._forget(request_id)
            if placed is not None and placed[1] is not None:  # adopted ones: their gateway watches the cluster
                decisions.append(Fail(placed[1], "UNAVAILABLE", f"{reason}; the request was lost", retry=True))
        return decisions

    def silent(self, now: float) -> list[Decision]:
        """Drop the workers that sent nothing (no heartbeat, no report) for `worker_timeout_s` (a pass over
        them only when the oldest message may be that old)."""
        timeout = self.config.worker_timeout_s
        if now - self._oldest <= timeout and now >= self._oldest:
            return []
        decisions: list[Decision] = []
        for view in list(self.workers.values()):
            if now - view.last_heard > timeout:
                decisions += self.drop(view, f"worker {view.worker_id} stopped responding (nothing for {timeout:g} s)")
        self._oldest = min((w.last_heard for w in self.workers.values()), default=now)
        return decisions

    def listening(self, now: float, stall_s: float) -> float:
        """The scheduler's loop runs at `now` (each round). If it last ran over `stall_s` earlier, it read no
        worker's messages meanwhile (they are still unread): that gap, returned (else 0), is no worker's silence."""
        gap, self._listened = now - (self._listened if self._listened is not None else now), now
        if gap <= stall_s:
            return 0.0
        for view in self.workers.values():
            view.last_heard = min(now, view.last_heard + gap)
        self._oldest = min((w.last_heard for w in self.workers.values()), default=self._oldest)
        return gap

    def _forget(self, request_id: str) -> Placed | None:
        placed = self.placed.pop(request_id, None)
        if placed is not None:
            self.on_change(placed[0])
            if placed[1] is not None:
                self.holdings.remove(placed[0], placed[1])
        return placed

    def _count(self, view: WorkerView) -> None:
        """The worker's held requests and reserved pages, from its report and its unreported assignments."""
        unreported = view.unreported()
        view.held = len(view.reported) + len(unreported)
        tokens_per_page = view.report.tokens_per_page
        view.reserved_pages = sum(
            kv_pages(request, tokens_per_page) for r in unreported if (request := self.request(r)) is not None
        )
        self.on_change(view.worker_id)
