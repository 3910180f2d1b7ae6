"""Adapters in a worker's host RAM: the registry of validated adapters, by name and version.

`AdapterRegistry` holds validated adapters by name. Registering a name again makes a new
version; requests keep the version they started with, and an old version is dropped once no
request holds it. On a worker it is an LRU cache with a byte budget (`--adapter-cache-gb`):
versions no request holds are evicted past it, and fetched from the adapter store again.
Copying adapters into the GPU pool is `UnifiedPool`'s job (unified_pool.py).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from loraserve.errors import AdapterNotFoundError
from loraserve.worker.adapters import LoraAdapter
from loraserve.worker.request import AdapterKey

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    adapter: LoraAdapter
    nbytes: int
    holders: int = 0  # requests that hold this version


class AdapterRegistry:
    """Validated adapters in host RAM, by (name, version), within an optional byte budget.

    With `budget_bytes` set (a worker: the adapter store is the source of truth) the registry is
    an LRU cache: registering past the budget drops the least recently used versions no request
    holds, oldest first, and a dropped version is simply fetched again when next needed. Held
    versions are never dropped, so while every cached version is held the registry may run over
    its budget; it comes back under as requests release them. Without a budget (the offline
    engine, whose adapters have nowhere to be fetched back from) nothing is ever evicted.
    """

    def __init__(self, budget_bytes: int | None = None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._versions: OrderedDict[AdapterKey, _Entry] = OrderedDict()  # least recently used first
        self._latest: dict[str, int] = {}
        self._bytes = 0
        self.evictions = 0
        self._lock = threading.Lock()

    def register(self, name: str, adapter: LoraAdapter, version: int | None = None) -> AdapterKey:
        """Add `adapter` under `name` as its newest version (`version` if given, else the next one)."""
        with self._lock:
            version = version if version is not None else self._latest.get(name, 0) + 1
            key = (name, version)
            replaced = self._versions.get(key)
            self._remove(key)
            self._versions[key] = _Entry(adapter, adapter.nbytes, replaced.holders if replaced else 0)
            self._bytes += adapter.nbytes
            previous = self._latest.get(name)
            self._latest[name] = version
            if previous is not None and previous != version:
                self._drop_if_unused((name, previous))
            self._evict_over_budget(keep=key)
            return key

    def unregister(self, name: str) -> None:
        with self._lock:
            version = self._latest.pop(name, None)
            if version is None:
                raise AdapterNotFoundError(name, list(self._latest))
            self._drop_if_unused((name, version))

    def _drop_if_unused(self, key: AdapterKey) -> None:
        entry = self._versions.get(key)
        if entry is not None and entry.holders == 0 and self._latest.get(key[0]) != key[1]:
            self._remove(key)

    def _remove(self, key: AdapterKey) -> None:
        entry = self._versions.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    def _evict_over_budget(self, keep: AdapterKey | None = None) -> None:
        """Drop unheld versions, least recently used first, until the cache fits its budget."""
        if self.budget_bytes is None:
            return
        for key in [k for k, e in self._versions.items() if e.holders == 0 and k != keep]:
            if self._bytes <= self.budget_bytes:
                return
            self._remove(key)
            if self._latest.get(key[0]) == key[1]:
                del self._latest[key[0]]  # the name is unknown here until fetched again
            self.evictions += 1
            log.info("adapter cache: evicted %s v%d (over the %d-byte budget)", key[0], key[1], self.budget_bytes)

    @property
    def nbytes(self) -> int:
        """Host RAM held by cached adapter weights."""
        return self._bytes

    def latest(self, name: str) -> AdapterKey:
        version = self._latest.get(name)
        if version is None:
            raise AdapterNotFoundError(name, list(self._latest))
        return (name, version)

    def has(self, key: AdapterKey) -> bool:
        return key in self._versions

    def get(self, key: AdapterKey) -> LoraAdapter:
        return self._versions[key].adapter

    def hold(self, key: AdapterKey) -> None:
        """Pin a version for a request (and mark it most recently used) until `release`."""
        with self._lock:
            self._versions[key].holders += 1
            self._versions.move_to_end(key)

    def release(self, key: AdapterKey) -> None:
        with self._lock:
            self._versions[key].holders -= 1
            self._drop_if_unused(key)
            self._evict_over_budget()

    def is_current(self, key: AdapterKey) -> bool:
        return self._latest.get(key[0]) == key[1]

    def names(self) -> list[str]:
        return sorted(self._latest)
