"""Requests parked on their adapter: the fetches from the store in flight for this worker.

A request whose adapter is in neither the engine's host cache nor its pool waits here while a fetch
thread (`fetch_threads.py`) brings the adapter from the store; a PREFETCH starts fetches no request
waits on yet. When a fetch lands (`land`), the adapter is registered with the engine and the parked
requests start — or, if the fetch failed, end with its error — and the adapter is copied into the pool
in the background.
"""

from __future__ import annotations

import queue
from collections.abc import Callable

from loraserve.errors import LoraserveError
from loraserve.wire import AdapterKey, Prefetch
from loraserve.worker.engine import Engine
from loraserve.worker.fetch_threads import Fetched, FetchThreads


class ParkedRequests:
    """Adapters being fetched, each with the requests waiting for it (none: a prefetch)."""

    def __init__(self, engine: Engine, fetches: FetchThreads) -> None:
        self.engine, self.fetches = engine, fetches
        self.awaiting: dict[AdapterKey, list[str]] = {}  # adapter being fetched -> requests parked on it

    def park(self, request_id: str, key: AdapterKey, trace: dict | None) -> None:
        """`request_id` waits for `key`: fetch it, or join (and hurry) the fetch under way."""
        if key not in self.awaiting:
            self.awaiting[key] = []
            self.fetches.submit(key, False, trace)
        elif not self.awaiting[key]:  # only a prefetch of it is queued or under way: it waits for it now
            self.fetches.promote(key)
        self.awaiting[key].append(request_id)

    def unpark(self, request_id: str) -> None:
        for waiting in self.awaiting.values():
            if request_id in waiting:
                waiting.remove(request_id)

    def parked(self) -> list[str]:
        return [rid for waiting in self.awaiting.values() for rid in waiting]

    def prefetch(self, prefetch: Prefetch) -> None:
        """Copy the predicted adapters the engine holds into the pool, and fetch the others."""
        keys: list[AdapterKey] = list(prefetch.adapters)
        self.engine.prefetch(keys, prefetch.scores or None)  # remembers the scores, copies what is here
        for key in keys:
            if not self.engine.registry.has(key) and key not in self.awaiting:
                self.awaiting[key] = []
                self.fetches.submit(key, True, prefetch.trace or None)  # a hint's request trace

    def found(self, key: AdapterKey) -> str:
        """How a request's adapter stood when the request arrived (`metrics.ADAPTER_REQUESTS`): resident
        (in the pool, no load for it), ready (a prefetch had loaded it: the load finished before the
        request was scheduled), loading (a fetch or copy was under way), cold (its load starts now)."""
        pool = self.engine.pool
        if pool.is_resident(key):
            slot = pool.slot(key)
            if slot.ready is None:  # no background copy a step has not waited for yet
                return "resident"
            if not slot.copied:
                return "loading"
            return "resident" if slot.demand else "ready"
        return "loading" if key in self.awaiting else "cold"

    def land(self, start: Callable[[str, Fetched], None], fail: Callable[[str, LoraserveError], None]) -> None:
        """Take the fetches that finished: register each adapter and `start` its parked requests, or `fail`
        them with the fetch's error."""
        while True:
            try:
                result = self.fetches.results.get_nowait()
            except queue.Empty:
                return
            waiting = self.awaiting.pop(result.key, [])
            if result.error is not None:
                for request_id in waiting:
                    fail(request_id, result.error)
                continue
            if not self.engine.registry.has(result.key, result.adapter.sha256 or None):
                self.engine.add_adapter(result.key[0], result.adapter, version=result.key[1])
            for request_id in waiting:
                start(request_id, result)
            if result.for_prefetch or waiting:  # queued requests make it NEEDED: it may evict any idle one
                self.engine.prefetch([result.key], demand=bool(waiting))
