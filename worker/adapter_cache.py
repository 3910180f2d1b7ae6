"""Adapters on a worker: the host-RAM registry (names, versions) and their rows in the pool.

`AdapterRegistry` holds validated adapters by name. Registering a name again makes a new
version; requests keep the version they started with, and an old version is dropped once no
request holds it. On a worker it is an LRU cache with a byte budget (`--adapter-cache-gb`):
versions no request holds are evicted past it, and fetched from the adapter store again.

`AdapterLoader` copies an adapter's packed rows into the pages the step scheduler gave it,
either right away (a miss: the step waits) or in the background (a prefetch, on its own CUDA
stream or thread, never stalling a step). It keeps, per resident adapter, the tensors the
kernels index with.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from loraserve.errors import AdapterNotFoundError
from loraserve.worker.adapters import LoraAdapter
from loraserve.worker.model_config import ModelConfig
from loraserve.worker.pool_layout import AdapterLayout, PoolLayout
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


@dataclass
class Resident:
    """An adapter's place in the pool, in the forms the kernels want."""

    key: AdapterKey
    layout: AdapterLayout
    scale: float
    layers: frozenset[int]
    pages: torch.Tensor  # int32 [num_pages] on the compute device
    row_index: torch.Tensor  # int64 [num_rows]: physical row of each logical row
    ready: torch.cuda.Event | Future | None = None  # pending background copy
    prefetched: bool = False
    loaded_at: float = field(default_factory=time.monotonic)
    layer_flags: list[bool] = field(default_factory=list)  # per layer: has weights there (per-step metadata)


@dataclass
class LoadStats:
    prefetch_hits: int = 0  # needed by a step and already copied in by a prefetch
    prefetch_late: int = 0  # prefetch still in flight when needed (the step waited for the rest)
    misses: int = 0  # copied in on demand (the step waited for all of it)
    loads: int = 0
    prefetches: int = 0
    evictions: int = 0
    load_seconds: float = 0.0


class AdapterLoader:
    def __init__(self, registry: AdapterRegistry, pool: torch.Tensor, layout: PoolLayout, model: ModelConfig):
        self.registry, self.pool, self.layout, self.model = registry, pool, layout, model
        self.device = pool.device
        self.resident: dict[AdapterKey, Resident] = {}
        self.stats = LoadStats()
        self._stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._executor = None if self._stream else ThreadPoolExecutor(1, thread_name_prefix="adapter-prefetch")

    def footprint(self, key: AdapterKey) -> tuple[int, int]:
        adapter_layout = self.registry.get(key).layout(self.layout, self.model)
        return adapter_layout.num_pages, adapter_layout.useful_elements

    def _resident(self, key: AdapterKey, pages: list[int]) -> Resident:
        adapter = self.registry.get(key)
        adapter_layout = adapter.layout(self.layout, self.model)
        r = self.layout.rows_per_page
        logical = torch.arange(adapter_layout.num_rows)
        page_tensor = torch.tensor(pages, dtype=torch.int64)
        row_index = page_tensor[logical // r] * r + logical % r
        return Resident(
            key, adapter_layout, adapter.scale, frozenset(adapter.layers),
            page_tensor.to(device=self.device, dtype=torch.int32), row_index.to(self.device),
            layer_flags=[layer in adapter.layers for layer in range(self.layout.num_layers)],
        )  # fmt: skip

    def _copy(self, resident: Resident, adapter: LoraAdapter) -> None:
        """Pack and copy; takes the adapter itself, as a prefetch's copy may outlive its registry entry."""
        rows = adapter.pack(self.layout, self.model, self.pool.dtype)
        if self.device.type == "cuda":
            rows = rows.pin_memory().to(self.device, non_blocking=True)
        self.pool.index_copy_(1, resident.row_index, rows)

    def load_now(self, key: AdapterKey, pages: list[int]) -> None:
        """Copy an adapter into its freshly allocated pages before this step runs (a miss)."""
        start = time.perf_counter()
        resident = self._resident(key, pages)
        self._copy(resident, self.registry.get(key))
        self.resident[key] = resident
        self.stats.misses += 1
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - start

    def prefetch(self, key: AdapterKey, pages: list[int]) -> None:
        """Start copying an adapter into its pages in the background."""
        resident = self._resident(key, pages)
        resident.prefetched = True
        adapter = self.registry.get(key)  # the copy keeps this reference: evicting the entry cannot break it
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._copy(resident, adapter)
                resident.ready = torch.cuda.Event()
                resident.ready.record(self._stream)
        else:
            resident.ready = self._executor.submit(self._copy, resident, adapter)
        self.resident[key] = resident
        self.stats.prefetches += 1
        self.stats.loads += 1

    def copy_done(self, key: AdapterKey) -> bool:
        ready = self.resident[key].ready
        if ready is None:
            return True
        return ready.query() if isinstance(ready, torch.cuda.Event) else ready.done()

    def wait(self, key: AdapterKey) -> float:
        """Make sure a step can read `key`'s rows; returns seconds waited. Counts hits and misses."""
        resident = self.resident[key]
        if resident.ready is None:
            return 0.0
        start = time.perf_counter()
        if self.copy_done(key):
            self.stats.prefetch_hits += 1
        else:
            self.stats.prefetch_late += 1
        if isinstance(resident.ready, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(resident.ready)
        else:
            resident.ready.result()
        resident.ready = None
        return time.perf_counter() - start

    def evicted(self, key: AdapterKey) -> None:
        resident = self.resident.pop(key, None)
        if resident is not None:
            self.stats.evictions += 1
            if resident.ready is not None and not isinstance(resident.ready, torch.cuda.Event):
                resident.ready.result()  # never let a background copy outlive its pages

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
