"""The order of a worker's adapter fetches: a request waiting for its adapter goes before any prefetch.

Prefetches (the scheduler's predictions) and demand fetches (a request is parked on the adapter) share
the worker's few fetch threads. First come, first served, a burst of prefetch hints would make a waiting
request's fetch queue behind fetches nobody waits for yet, and its time to first token would pay for
them. So `take` hands out demand fetches first, each class in arrival order, and `promote` moves a
queued prefetch of an adapter a request now waits for into the demand class (its job keeps its place
among the demand fetches by the time it was promoted). A job is handed out once.

    queue.put(key, demand=False, trace)   # a prefetch
    queue.promote(key)                    # a request now waits for it: True if it was still queued
    job = queue.take(timeout)             # the next job, or None
"""

from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass, field

from loraserve.wire import AdapterKey

DEMAND, PREFETCH = 0, 1  # priorities: lower goes first


@dataclass
class FetchJob:
    key: AdapterKey
    demand: bool
    trace: dict | None = None
    taken: bool = field(default=False, repr=False)


class FetchQueue:
    """Queued fetches by priority, then arrival (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, FetchJob]] = []
        self._queued: dict[AdapterKey, FetchJob] = {}  # not yet taken
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._closed = False

    def put(self, key: AdapterKey, demand: bool, trace: dict | None = None) -> None:
        with self._ready:
            job = self._queued.get(key)
            if job is not None:  # already queued: at most raise its priority
                if demand and not job.demand:
                    self._raise(job)
                return
            job = self._queued[key] = FetchJob(key, demand, trace)
            heapq.heappush(self._heap, (DEMAND if demand else PREFETCH, next(self._order), job))
            self._ready.notify()

    def promote(self, key: AdapterKey) -> bool:
        """A request now waits for `key`: its queued prefetch becomes a demand fetch. False if no fetch of
        it is queued (it is under way already, or was never asked for)."""
        with self._ready:
            job = self._queued.get(key)
            if job is None:
                return False
            if not job.demand:
                self._raise(job)
            return True

    def take(self, timeout: float | None = None) -> FetchJob | None:
        """The next job (demand first), waiting up to `timeout` for one; None on timeout or once closed."""
        with self._ready:
            while True:
                while self._heap:
                    _, _, job = heapq.heappop(self._heap)
                    if job.taken:  # the entry a promotion left behind
                        continue
                    job.taken = True
                    del self._queued[job.key]
                    return job
                if self._closed or not self._ready.wait(timeout):
                    return None

    def close(self) -> None:
        """Wake every `take`; queued jobs are dropped."""
        with self._ready:
            self._closed = True
            self._heap.clear()
            self._queued.clear()
            self._ready.notify_all()

    def __len__(self) -> int:
        with self._ready:
            return len(self._queued)

    def _raise(self, job: FetchJob) -> None:
        """Re-queue `job` as a demand fetch; its old entry is skipped when popped (marked via a new job)."""
        job.taken = True  # the old heap entry
        raised = self._queued[job.key] = FetchJob(job.key, True, job.trace)
        heapq.heappush(self._heap, (DEMAND, next(self._order), raised))
        self._ready.notify()
