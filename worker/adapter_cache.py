"""Adapters on a worker: the host-RAM registry (names, versions) and their rows in the pool.

`AdapterRegistry` holds validated adapters by name. Registering a name again makes a new
version; requests keep the version they started with, and an old version is dropped once no
request holds it.

`AdapterLoader` copies an adapter's packed rows into the pages the step scheduler gave it,
either right away (a miss: the step waits) or in the background (a prefetch, on its own CUDA
stream or thread, never stalling a step). It keeps, per resident adapter, the tensors the
kernels index with.
"""

from __future__ import annotations

import logging
import threading
import time
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
    holders: int = 0  # requests that hold this version


class AdapterRegistry:
    def __init__(self) -> None:
        self._versions: dict[AdapterKey, _Entry] = {}
        self._latest: dict[str, int] = {}
        self._lock = threading.Lock()

    def register(self, name: str, adapter: LoraAdapter, version: int | None = None) -> AdapterKey:
        """Add `adapter` under `name` as its newest version (`version` if given, else the next one)."""
        with self._lock:
            version = version if version is not None else self._latest.get(name, 0) + 1
            key = (name, version)
            self._versions[key] = _Entry(adapter)
            previous = self._latest.get(name)
            self._latest[name] = version
            if previous is not None and previous != version:
                self._drop_if_unused((name, previous))
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
            del self._versions[key]

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
        with self._lock:
            self._versions[key].holders += 1

    def release(self, key: AdapterKey) -> None:
        with self._lock:
            self._versions[key].holders -= 1
            self._drop_if_unused(key)

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

    def _copy(self, resident: Resident) -> None:
        rows = self.registry.get(resident.key).pack(self.layout, self.model, self.pool.dtype)
        if self.device.type == "cuda":
            rows = rows.pin_memory().to(self.device, non_blocking=True)
        self.pool.index_copy_(1, resident.row_index, rows)

    def load_now(self, key: AdapterKey, pages: list[int]) -> None:
        """Copy an adapter into its freshly allocated pages before this step runs (a miss)."""
        start = time.perf_counter()
        resident = self._resident(key, pages)
        self._copy(resident)
        self.resident[key] = resident
        self.stats.misses += 1
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - start

    def prefetch(self, key: AdapterKey, pages: list[int]) -> None:
        """Start copying an adapter into its pages in the background."""
        resident = self._resident(key, pages)
        resident.prefetched = True
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._copy(resident)
                resident.ready = torch.cuda.Event()
                resident.ready.record(self._stream)
        else:
            resident.ready = self._executor.submit(self._copy, resident)
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
