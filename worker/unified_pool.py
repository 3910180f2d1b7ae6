"""The unified pool: one tensor for KV cache and adapter weights, and the one object that owns it.

`UnifiedPool` owns the pool's adapters: where each resident adapter's rows are (its `AdapterSlot`, the
form the kernels index), scores and the copies in flight. Which page belongs to which sequence or adapter,
pins and the prefix index are its `pages` (`PagePool`), exposed once: the step scheduler grows, attaches
and frees KV pages and pins adapters there, and the reports read it. It decides; its `copier`
(`PoolCopier`, `pool_copier.py`) holds the tensor and makes the copies. The step scheduler asks it for
room; the engine asks it to prefetch and to drop stale versions; the runner reads slots and page tables.
Nothing else keeps a copy of any of this, so nothing has to be kept in step by hand: evicting an
adapter frees its pages, forgets its slot and settles its copy in one call.

    pool = UnifiedPool(layout, model_config, host_cache, dtype, device)
    pool.ensure(key, keep)            # resident now (copied in if it was not): a miss
    pool.remember_scores(scores)      # the scheduler's predictions: how likely each adapter is needed
    pool.prefetch(keys, reserve)      # copy these in the background, ahead of need
    pool.make_room(pages, keep, for_kv=True)   # evict idle adapters until pages are free
    pool.wait_ready(key, by_layer)    # before a step reads the adapter's rows (or per layer, in the model)

Adapter weights come from the host cache (`AdapterRegistry`): an adapter's footprint and packed
rows are computed from its validated weights there. `copier.prepare(adapter)` packs the rows ahead of time
(pinned for a CUDA pool) on whatever thread calls it (the worker's fetch threads), so that copying
an adapter in, on the step loop or in the background, is only a copy.

Prefetch never evicts an adapter more likely to be used than the one it fetches. Each adapter has a
score, the predicted likelihood that it is needed here soon: 1.0 (`NEEDED`) for an adapter a queued
request needs, else the latest score the scheduler sent (`remember_scores`), else `UNKNOWN_SCORE`.
A prefetch takes free pages, or pages of idle adapters scored strictly lower than the one it
fetches; a request's own load (`ensure`) may still evict any idle adapter, least recently used first.

Copies go layer by layer, layer 0 first (`PoolCopier`). A background copy marks each layer done
(`LayerProgress`), so a step that needs the adapter before
the copy finished waits per layer inside the model (`wait_ready(key, by_layer=True)`): its prefill starts
as soon as layer 0 is in.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from loraserve.errors import ResourceExhaustedError
from loraserve.model_config import ModelConfig
from loraserve.pool_rows import ceil_div
from loraserve.wire import AdapterKey
from loraserve.worker.adapter_cache import AdapterRegistry
from loraserve.worker.layer_progress import LayerProgress
from loraserve.worker.page_pool import EvictionPolicy, PagePool
from loraserve.worker.pool_copier import PoolCopier
from loraserve.worker.pool_layout import PoolLayout

log = logging.getLogger(__name__)

NEEDED = 1.0  # the score of an adapter a request queued here needs
UNKNOWN_SCORE = 0.5  # the score of an adapter nobody predicted (a prefetch then evicts only lower ones)
MAX_SCORES = 1 << 14  # scores remembered, the most recently updated ones


def prefetch_targets(
    keys: Iterable[AdapterKey],
    needed: frozenset[AdapterKey],
    is_resident: Callable[[AdapterKey], bool],
    resident: Callable[[], Iterable[AdapterKey]],
    score: Callable[[AdapterKey], float],
) -> Iterator[tuple[AdapterKey, frozenset[AdapterKey]]]:
    """The prefetch rule: each hinted adapter not yet resident, in order, with the adapters making room
    for it must not evict — the other hinted ones, those queued requests need (scored NEEDED), and
    every resident adapter scored at least as high as it. `resident` is asked again for each, as earlier
    copies change it."""
    keys = list(dict.fromkeys(keys))
    wanted = frozenset(keys) | needed

    def scored(key: AdapterKey) -> float:
        return NEEDED if key in needed else score(key)

    for key in keys:
        if is_resident(key):
            continue
        fetched = scored(key)
        yield key, wanted | frozenset(k for k in resident() if scored(k) >= fetched)


@dataclass
class AdapterSlot:
    """A resident adapter's place in the pool, as the LoRA kernels index it (`kernels.batch.PooledAdapter`)."""

    key: AdapterKey
    rank: int
    scale: float
    a_offsets: tuple[int, ...]  # [7]: first logical row of each module's A block, -1 if not targeted
    b_offsets: tuple[int, ...]
    layers: list[bool]  # [L]: has weights in that layer
    pages: tuple[int, ...]  # its pages in logical order (host ints: the step's metadata builder reads them)
    row_index: torch.Tensor  # int64 [num_rows]: physical row of each logical row
    useful_elements: int  # weights stored, over all layers (what a step reads), in pool elements
    row_dtype: torch.dtype | None = None  # its rows' dtype when not the pool's (`adapter_precision.py`)
    ready: LayerProgress | None = field(default=None, repr=False)  # a background copy, until a step saw it done
    demand: bool = False  # that copy is for requests already waiting on it: a miss when used, not a hit
    counted: bool = False  # a step used it while it was being copied (its hit or miss is counted)

    @property
    def copied(self) -> bool:
        """Its rows are all in the pool (no copy in flight, or the copy finished)."""
        return self.ready is None or self.ready.done()


@dataclass
class LoadStats:
    prefetch_hits: int = 0  # needed by a step and already copied in by a prefetch
    prefetch_late: int = 0  # prefetch still in flight when needed (the step waited for the rest)
    misses: int = 0  # copied in on demand (the step waited for all of it, or its requests for the fetch)
    loads: int = 0
    prefetches: int = 0
    evictions: int = 0
    load_seconds: float = 0.0

    def count_use(self, demand: bool, copied: bool) -> None:
        """A step first used an adapter that a background copy brought in: for waiting requests
        (`demand`: a miss), or a prefetch finished (a hit) or still in flight (late)."""
        if demand:
            self.misses += 1
        elif copied:
            self.prefetch_hits += 1
        else:
            self.prefetch_late += 1


class UnifiedPool:
    """The one owner of every page of the pool: KV pages, resident adapters and their slots, pins,
    scores and background copies (see the module docstring); its `copier` holds the tensor."""

    def __init__(
        self,
        layout: PoolLayout,
        model: ModelConfig,
        host: AdapterRegistry,
        dtype: torch.dtype,
        device: torch.device,
        adapter_pages: int | None = None,
        policy: EvictionPolicy | None = None,
        zeroed: bool = True,
        copy_threads: int = 2,
        copier: type[PoolCopier] = PoolCopier,  # a tensor-parallel worker's rank 0 passes a SharingCopier
        adapter_dtype: str = "pool",  # adapters' precision in the pool (`adapter_precision.py`)
    ) -> None:
        self.layout, self.model, self.host = layout, model, host
        self.copier = copier(layout, model, dtype, device, zeroed, copy_threads, adapter_dtype)
        self.tensor = self.copier.tensor  # [L, pages * R, W]: KV and adapters (the runner reads it)
        self.device = device
        self.pages = PagePool(layout, adapter_pages, policy)  # who owns which page: KV, adapters, pins, prefixes
        self._slots: dict[AdapterKey, AdapterSlot] = {}
        self._prefetching: set[AdapterKey] = set()  # pinned while their background copy runs
        self._scores: OrderedDict[AdapterKey, float] = OrderedDict()  # latest predicted likelihoods
        self.stats = LoadStats()

    # ---- queries (the pages themselves: `pages`) -------------------------------------------------
    def slot(self, key: AdapterKey) -> AdapterSlot:
        return self._slots[key]

    def standing(self, key: AdapterKey) -> str | None:
        """How `key` stands in the pool, as a request for it finds it (`metrics.ADAPTER_REQUESTS`): resident
        (no load for it), ready (a prefetch had loaded it: the copy finished before the request came),
        loading (a copy is under way); None when it is not resident."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        if slot.ready is None:  # no background copy a step has not waited for yet
            return "resident"
        if not slot.copied:
            return "loading"
        return "resident" if slot.demand else "ready"

    def score(self, key: AdapterKey) -> float:
        """The latest predicted likelihood that `key` is needed soon (UNKNOWN_SCORE if none was sent)."""
        return self._scores.get(key, UNKNOWN_SCORE)

    def copying(self) -> bool:
        """True while a prefetch's background copy is in flight."""
        return bool(self._prefetching)

    def check_invariants(self) -> None:
        """Pages owned once each, and a slot exactly for every resident adapter (tests use it)."""
        self.pages.check_invariants()
        if set(self._slots) != set(self.pages.resident_adapters()):
            raise AssertionError("resident adapters and slots disagree")

    # ---- KV cache ------------------------------------------------------------------------------
    def reserve_kv_page(self, seq: Hashable) -> int:
        """One KV page for `seq`, kept for the pool's lifetime (padded steps write there); its number."""
        if not self.pages.grow_kv(seq, 1):
            raise ResourceExhaustedError("no free page left to reserve for decode padding")
        return self.pages.kv_page_table(seq)[0]

    # ---- adapters ------------------------------------------------------------------------------
    def make_room(self, num_pages: int, keep: frozenset = frozenset(), for_kv: bool = False) -> bool:
        """Evict idle adapters (never pinned ones or those in `keep`) until `num_pages` are free for KV
        (`for_kv`) or for an adapter; evicts nothing and returns False when that cannot be done."""
        evicted = self.pages.evict_for(num_pages, keep=keep, for_kv=for_kv)
        if evicted is None:
            return False
        for key in evicted:
            self._forget(key)
        return True

    def ensure(self, key: AdapterKey, keep: frozenset = frozenset()) -> bool:
        """Make `key` resident, copying it in now if it is not (a miss). False if it cannot fit now."""
        if self.pages.is_resident(key):
            return True
        if not self._allocate(key, keep):
            return False
        start = time.perf_counter()
        slot = self._slots[key]
        self.copier.copy(slot.pages, len(slot.row_index), self.host.get(key))
        self.stats.misses += 1
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - start
        return True

    def remember_scores(self, scores: Iterable[tuple[AdapterKey, float]]) -> None:
        """Remember the latest predicted likelihood (in [0, 1]) of each adapter, resident or not."""
        for key, score in scores:
            self._scores[key] = min(1.0, max(0.0, score))
            self._scores.move_to_end(key)
        while len(self._scores) > MAX_SCORES:
            self._scores.popitem(last=False)

    def prefetch(
        self, keys: list[AdapterKey], reserve_pages: int, needed: frozenset = frozenset(), demand: bool = False
    ) -> list[AdapterKey]:
        """Start copying predicted adapters into the pool in the background, in the order given.

        Each takes free pages, or the pages of idle adapters with a strictly lower score (see the
        module docstring; `needed`: adapters queued requests need, scored NEEDED); pinned ones and
        the other `keys` are never evicted, and `reserve_pages` stay free for KV growth (ignored in
        a split pool, where adapters cannot take KV pages anyway). An adapter that does not fit so
        is skipped. Returns the adapters whose copy started; each stays pinned until its copy is done.
        `demand`: the copies are for requests already waiting on them (an adapter just fetched for
        them), not predictions: a step using one counts a miss, and `prefetches` does not count them.
        """
        reserve = 0 if self.pages.split else reserve_pages
        started = []
        for key, keep in prefetch_targets(
            keys, needed, self.pages.is_resident, self.pages.resident_adapters, self.score
        ):
            if not self._allocate(key, keep, extra_pages=reserve):
                continue
            self.pages.pin(key)  # a page being written must not be handed to anyone else
            self._prefetching.add(key)
            slot = self._slots[key]
            slot.demand = demand
            slot.ready = self.copier.copy_in_background(slot.pages, len(slot.row_index), self.host.get(key), demand)
            self.stats.prefetches += not demand
            self.stats.loads += 1
            started.append(key)
        return started

    def settle(self) -> None:
        """Unpin the prefetches whose copy finished (called once per step)."""
        for key in [k for k in self._prefetching if self._slots[k].copied]:
            self._prefetching.discard(key)
            self.pages.unpin(key)

    def wait_ready(self, key: AdapterKey, by_layer: bool = False) -> float:
        """Make sure a step can read `key`'s rows; returns seconds waited. Counts prefetch hits.

        `by_layer`: the step's model waits for each layer itself (`slot.ready.wait_layer`) when the copy is
        still running; this then returns at once and leaves the progress on the slot until `settle`."""
        slot = self._slots[key]
        if slot.ready is None:
            return 0.0
        start = time.perf_counter()
        done = slot.copied
        if not slot.counted:  # else an earlier step already read it while it was being copied
            self.stats.count_use(slot.demand, done)
        slot.counted = True
        if by_layer and not done:
            return 0.0
        slot.ready.wait_all()
        slot.ready = None
        return time.perf_counter() - start

    def layer_wait_s(self, key: AdapterKey) -> float:
        """Seconds steps blocked on `key`'s copy inside the model since the last call (CPU; 0 on CUDA)."""
        slot = self._slots.get(key)
        if slot is None or slot.ready is None:
            return 0.0
        waited, slot.ready.waited_s = slot.ready.waited_s, 0.0
        return waited

    def discard_stale(self, key: AdapterKey) -> None:
        """Free the pages of a version no request can use any more (superseded and not pinned)."""
        if self.host.is_current(key) or not self.pages.is_resident(key) or self.pages.is_pinned(key):
            return
        self.pages.free_adapter(key)
        self._forget(key)

    # ---- internals -----------------------------------------------------------------------------
    def _allocate(self, key: AdapterKey, keep: frozenset, extra_pages: int = 0) -> bool:
        """Pages and a slot for `key`, evicting idle adapters not in `keep`; the data is not copied yet."""
        adapter = self.host.get(key)
        layout = adapter.layout(self.layout, self.model)
        row_dtype = self.copier.row_dtype(adapter)
        per_page = self.copier.rows_per_page(row_dtype)
        num_pages = ceil_div(layout.num_rows, per_page)
        useful = layout.useful_elements * self.layout.rows_per_page // per_page
        if not self.make_room(num_pages + extra_pages, keep=keep):
            return False
        pages = self.pages.allocate_adapter(key, num_pages, useful)
        self._slots[key] = AdapterSlot(
            key,
            layout.rank,
            adapter.scale,
            layout.a_offsets,
            layout.b_offsets,
            [layer in adapter.layers for layer in range(self.layout.num_layers)],
            tuple(pages),
            self.copier.row_index(pages, layout.num_rows, row_dtype),
            useful,
            row_dtype,
        )
        return True

    def _forget(self, key: AdapterKey) -> None:
        """The pages of `key` were freed: drop its slot, never letting a background copy outlive them."""
        slot = self._slots.pop(key)
        self.stats.evictions += 1
        if slot.ready is not None:
            slot.ready.join()
