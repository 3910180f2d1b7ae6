"""Adapters in a worker's host RAM: the registry of validated adapters, by name and version.

`AdapterRegistry` holds validated adapters by name. Registering a name again makes a new
version; requests keep the version they started with, and an old version is dropped once no
request holds it. On a worker it is an LRU cache with a byte budget (`--adapter-cache-gb`):
versions no request holds are evicted past it, and fetched from the adapter store again.
Copying adapters into the GPU pool is `UnifiedPool`'s job (unified_pool.py).

Each cached version keeps the content hash of its weights (`LoraAdapter.sha256`, checked against
the bytes when they were fetched). `has(key, expected_sha256)` / `get(key, expected_sha256)` trust
a cached entry only when that hash matches what the caller expects for (name, version): a stale
entry (a store that lost its data and gave the number out again) is a miss, never served.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from loraserve.errors import AdapterNotFoundError
from loraserve.wire import AdapterKey
from loraserve.worker.adapters import LoraAdapter

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
        self.stale_drops = 0  # lookups that found a cached version with other weights than expected
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

    def has(self, key: AdapterKey, expected_sha256: str | None = None) -> bool:
        """True if `key` is cached and, with `expected_sha256`, its weights have exactly that sha256.

        A cached version whose hash differs from (or, fetched without one, cannot be compared with)
        `expected_sha256` is stale: it is dropped unless a request holds it (then it stays, for that
        request, until released) and this is a miss, so the caller fetches the adapter again. The
        caller should then also free its pool pages (`UnifiedPool.discard_stale(key)`).
        """
        if expected_sha256 is None:
            return key in self._versions
        with self._lock:
            return self._fresh_locked(key, expected_sha256) is not None

    def get(self, key: AdapterKey, expected_sha256: str | None = None) -> LoraAdapter:
        """The cached adapter; KeyError when not cached or, with `expected_sha256`, stale (see `has`)."""
        if expected_sha256 is None:
            return self._versions[key].adapter
        with self._lock:
            entry = self._fresh_locked(key, expected_sha256)
        if entry is None:
            raise KeyError(key)
        return entry.adapter

    def sha256(self, key: AdapterKey) -> str | None:
        """The content hash of a cached version's weights (None when unknown: registered from a path)."""
        return self._versions[key].adapter.sha256

    def _fresh_locked(self, key: AdapterKey, expected_sha256: str) -> _Entry | None:
        entry = self._versions.get(key)
        if entry is None or entry.adapter.sha256 == expected_sha256:
            return entry
        held = entry.holders > 0
        log.warning(
            "adapter cache: %s v%d holds weights with sha256 %s, expected %s: stale, %s",
            key[0],
            key[1],
            (entry.adapter.sha256 or "unknown")[:16],
            expected_sha256[:16],
            "kept only for the requests holding it" if held else "dropped",
        )
        self.stale_drops += 1
        if not held:
            self._remove(key)
            if self._latest.get(key[0]) == key[1]:
                del self._latest[key[0]]
        return None

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
