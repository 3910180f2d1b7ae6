"""Requests parked on their adapter: the fetches from the store in flight for this worker (pure bookkeeping).

A request whose adapter is in neither the engine's host cache nor its pool waits here while a fetch
thread (`fetch_threads.py`) brings the adapter from the store; a PREFETCH starts fetches no request
waits on yet. Parking decides the fetch to start (or the queued prefetch to hurry); when a fetch lands,
`land` hands back the requests that waited on it. The worker's core (`core.py`) owns one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from loraserve.wire import AdapterKey
from loraserve.worker.effects import Fetch, Promote


class ParkedRequests:
    """Adapters being fetched, each with the requests waiting for it (none: a prefetch)."""

    def __init__(self) -> None:
        self.awaiting: dict[AdapterKey, list[str]] = {}  # adapter being fetched -> requests parked on it

    def park(self, request_id: str, key: AdapterKey, trace: dict | None) -> Fetch | Promote | None:
        """`request_id` waits for `key`: fetch it, or join (and hurry) the fetch under way."""
        effect: Fetch | Promote | None = None
        if key not in self.awaiting:
            self.awaiting[key] = []
            effect = Fetch(key, False, trace)
        elif not self.awaiting[key]:  # only a prefetch of it is queued or under way: it waits for it now
            effect = Promote(key)
        self.awaiting[key].append(request_id)
        return effect

    def unpark(self, request_id: str) -> None:
        for waiting in self.awaiting.values():
            if request_id in waiting:
                waiting.remove(request_id)

    def parked(self) -> list[str]:
        return [rid for waiting in self.awaiting.values() for rid in waiting]

    def prefetch(
        self, keys: Iterable[AdapterKey], trace: dict | None, held: Callable[[AdapterKey], bool]
    ) -> list[Fetch]:
        """Fetch the predicted adapters the engine does not hold (`held`) and nobody fetches yet."""
        fetches = []
        for key in keys:
            if not held(key) and key not in self.awaiting:
                self.awaiting[key] = []
                fetches.append(Fetch(key, True, trace))  # a hint's request trace
        return fetches

    def fetching(self, key: AdapterKey) -> bool:
        return key in self.awaiting

    def land(self, key: AdapterKey) -> list[str]:
        """The fetch of `key` finished: the requests that waited on it."""
        return self.awaiting.pop(key, [])
