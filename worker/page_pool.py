"""Who owns which page of the unified pool: sequences' KV cache and resident adapters.

A pure bookkeeping object (no tensors), held by `UnifiedPool` as its `pages` (unified_pool.py), whose
copier owns the tensor and copies the data. There is no static split between KV and adapters — both draw from one
free list. Adapters stay resident while unused and are evicted only when someone needs their
pages, in the order an `EvictionPolicy` chooses (least recently used by default); an adapter
pinned by a running request or an in-flight copy is never evicted.

KV pages are reference-counted (prefix caching): a full page whose KV is known to hold a given
block of tokens (`register_kv_page`, under its block hash: `loraserve/prefix_keys.py`; the
`PrefixIndex` remembers which) can be attached to other sequences with the same prefix
(`prefixes.lookup`, `attach_kv`), which only read it. When no
sequence holds a registered page any more it stays cached, idle, in least-recently-released order,
and is reclaimed only when pages are needed: free pages first, then idle cached pages (oldest
first), and only then idle adapters. So a cold cached KV page is always given up before an idle
adapter (recomputing a page of KV costs one page of prefill; reloading an adapter costs a copy of
all of it), and `room` counts idle cached pages as available.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol

from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.prefix_index import PrefixIndex


@dataclass(frozen=True)
class PoolStats:
    total_pages: int
    free_pages: int
    kv_pages: int  # pages sequences hold (a shared one once)
    adapter_pages: int
    resident_adapters: int
    pinned_adapters: int
    waste_fraction: float  # 1 - useful elements / elements of allocated pages (padding, partial pages)
    cached_pages: int = 0  # idle pages kept for their cached KV (reclaimable)

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class EvictionPolicy(Protocol):
    def victims(self, candidates: list[Hashable]) -> Iterable[Hashable]:
        """The order to evict `candidates` in (given least recently used first; all unpinned)."""
        ...


class LeastRecentlyUsed:
    def victims(self, candidates: list[Hashable]) -> Iterable[Hashable]:
        return candidates


@dataclass
class _Adapter:
    pages: list[int]
    useful_elements: int
    pins: int = 0


class PagePool:
    """Page ownership. With `adapter_pages` set, the pool is *split* instead of unified: adapters may
    use at most that many pages and KV the rest (the S-LoRA ablation the benchmark measures)."""

    def __init__(
        self, layout: PoolLayout, adapter_pages: int | None = None, policy: EvictionPolicy | None = None
    ) -> None:
        self.layout = layout
        self.policy = policy or LeastRecentlyUsed()
        if adapter_pages is not None and not 0 < adapter_pages < layout.num_pages:
            raise ValueError(f"adapter_pages must be in (0, {layout.num_pages}), got {adapter_pages}")
        self.adapter_cap = adapter_pages
        self._free: list[int] = list(range(layout.num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._kv: dict[Hashable, list[int]] = {}  # sequence -> its pages, in token order
        self._kv_tokens: dict[Hashable, int] = {}  # sequence -> tokens it holds room for
        self._adapters: OrderedDict[Hashable, _Adapter] = OrderedDict()  # least recently used first
        self._refs: dict[int, int] = {}  # KV page a sequence holds -> how many hold it
        self.prefixes = (
            PrefixIndex()
        )  # registered KV pages: their blocks, the idle ones, fingerprints (epoch, evictions)

    # ---- queries ------------------------------------------------------------------------------
    def kv_page_table(self, seq: Hashable) -> list[int]:
        return self._kv.get(seq, [])

    def adapter_pages(self, key: Hashable) -> list[int] | None:
        entry = self._adapters.get(key)
        return entry.pages if entry else None

    def is_resident(self, key: Hashable) -> bool:
        return key in self._adapters

    def is_pinned(self, key: Hashable) -> bool:
        entry = self._adapters.get(key)
        return bool(entry and entry.pins)

    def resident_adapters(self) -> list[Hashable]:
        """Resident adapters, least recently used first."""
        return list(self._adapters)

    def evictable_pages(self, keep: frozenset = frozenset()) -> int:
        return sum(len(a.pages) for k, a in self._adapters.items() if not a.pins and k not in keep)

    @property
    def split(self) -> bool:
        return self.adapter_cap is not None

    def _kv_used(self) -> int:
        return len(self._refs)

    def _adapter_used(self) -> int:
        return sum(len(a.pages) for a in self._adapters.values())

    def room(self, for_kv: bool) -> int:
        """Pages KV (or adapters) may take now: free ones and idle cached ones."""
        available = len(self._free) + self.prefixes.idle_count()
        if not self.split:
            return available
        if for_kv:
            return min(available, self.layout.num_pages - self.adapter_cap - self._kv_used())
        return min(available, self.adapter_cap - self._adapter_used())

    def _take(self, count: int) -> list[int]:
        """`count` pages: free ones, then idle cached ones, oldest first (their cached KV is forgotten)."""
        pages = []
        while len(pages) < count:
            pages.append(self._free.pop() if self._free else self.prefixes.reclaim_oldest())
        return pages

    def kv_pages_to_grow(self, seq: Hashable, num_tokens: int) -> int:
        """Pages `seq` still needs to hold `num_tokens` tokens."""
        return max(0, self.layout.kv_pages_for(num_tokens) - len(self._kv.get(seq, ())))

    # ---- KV cache ------------------------------------------------------------------------------
    def grow_kv(self, seq: Hashable, num_tokens: int) -> bool:
        """Make room for `num_tokens` tokens of `seq` (all or nothing; never evicts). True on success."""
        need = self.kv_pages_to_grow(seq, num_tokens)
        if need > self.room(for_kv=True):
            return False
        pages = self._kv.setdefault(seq, [])
        new = self._take(need)
        for page in new:
            self._refs[page] = 1
        pages.extend(new)
        self._kv_tokens[seq] = max(self._kv_tokens.get(seq, 0), num_tokens)
        return True

    def free_kv(self, seq: Hashable) -> int:
        """Release every page of `seq` (a page others hold stays theirs; a registered one stays cached,
        idle); returns how many it held."""
        pages = self._kv.pop(seq, [])
        self._kv_tokens.pop(seq, None)
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            del self._refs[page]
            if not self.prefixes.release(page):
                self._free.append(page)
        return len(pages)

    # ---- prefix caching ------------------------------------------------------------------------
    def attach_kv(self, seq: Hashable, pages: list[int]) -> None:
        """Start `seq`, which holds no page yet, with `pages` (from `prefixes.lookup`), read-only: its own KV
        goes in pages it grows after them."""
        if seq in self._kv:
            raise ValueError(f"sequence {seq!r} already holds pages")
        for page in pages:
            self._refs[page] = self._refs.get(page, 0) + 1
            self.prefixes.claim(page)
        self._kv[seq] = list(pages)
        self._kv_tokens[seq] = len(pages) * self.layout.tokens_per_page

    def register_kv_page(self, seq: Hashable, index: int, block: bytes, fingerprint: bytes | None = None) -> None:
        """Page `index` of `seq` is full and holds the KV of the block hashed `block`: other sequences
        with that prefix may attach it. A block already registered keeps its page. `fingerprint`: the
        page ends a checkpoint prefix (`loraserve/prefix_keys.py`), reported to the scheduler."""
        self.prefixes.register(self._kv[seq][index], block, fingerprint)

    # ---- adapters ------------------------------------------------------------------------------
    def allocate_adapter(self, key: Hashable, num_pages: int, useful_elements: int) -> list[int] | None:
        """Pages for a new resident adapter, or None if there are not enough free pages (never evicts)."""
        if key in self._adapters:
            raise ValueError(f"adapter {key!r} is already resident")
        if num_pages > self.room(for_kv=False):
            return None
        pages = self._take_run(num_pages) or self._take(num_pages)
        self._adapters[key] = _Adapter(pages, useful_elements)
        return pages

    def _take_run(self, count: int) -> list[int] | None:
        """The highest `count` consecutive free pages, or None where no such run is free. An adapter on
        consecutive pages is read where it lies (`kernels/lora_torch.py`) rather than gathered; KV takes
        the lowest free pages first, so runs from the top stay clear of it."""
        start, length, previous = None, 0, None
        for page in sorted(self._free, reverse=True):
            length = length + 1 if previous is not None and page == previous - 1 else 1
            previous = page
            if length == count:
                start = page
                break
        if start is None:
            return None
        taken = range(start, start + count)
        self._free = [p for p in self._free if p not in taken]
        return list(taken)

    def pin(self, key: Hashable) -> None:
        """A running request (or a copy in flight) uses a resident adapter: it cannot be evicted until
        `unpin`, and it is now the most recently used."""
        self._adapters[key].pins += 1
        self._adapters.move_to_end(key)

    def unpin(self, key: Hashable) -> None:
        entry = self._adapters[key]
        if entry.pins <= 0:
            raise ValueError(f"adapter {key!r} is not pinned")
        entry.pins -= 1

    def free_adapter(self, key: Hashable) -> None:
        entry = self._adapters[key]
        if entry.pins:
            raise ValueError(f"adapter {key!r} is pinned by {entry.pins} running request(s)")
        del self._adapters[key]
        self._free.extend(reversed(entry.pages))

    def evict_for(self, num_pages: int, keep: frozenset = frozenset(), for_kv: bool = False) -> list[Hashable] | None:
        """Evict unpinned adapters (LRU first, never those in `keep`) until `num_pages` are free for
        KV (`for_kv`) or for an adapter.

        Returns the evicted keys, or None — evicting nothing — when even evicting every candidate
        would not free enough (in a split pool, evicting adapters never makes room for KV).
        """
        short = num_pages - self.room(for_kv)
        if short <= 0:
            return []
        if self.split and for_kv:
            return None
        if self.evictable_pages(keep) < short:
            return None
        evicted = []
        candidates = [k for k, entry in self._adapters.items() if not entry.pins and k not in keep]
        for key in self.policy.victims(candidates):
            if short <= 0:
                break
            short -= len(self._adapters[key].pages)
            self.free_adapter(key)
            evicted.append(key)
        return evicted

    # ---- accounting ----------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        layout = self.layout
        kv_pages = len(self._refs)
        adapter_pages = sum(len(a.pages) for a in self._adapters.values())
        tokens = min(sum(self._kv_tokens.values()), kv_pages * layout.tokens_per_page)  # a shared page once
        kv_useful = tokens * 2 * layout.row_width * layout.num_layers
        adapter_useful = sum(a.useful_elements for a in self._adapters.values())
        allocated = (kv_pages + adapter_pages) * layout.page_elements
        waste = 1.0 - (kv_useful + adapter_useful) / allocated if allocated else 0.0
        return PoolStats(
            total_pages=layout.num_pages,
            free_pages=len(self._free),
            kv_pages=kv_pages,
            adapter_pages=adapter_pages,
            resident_adapters=len(self._adapters),
            pinned_adapters=sum(1 for a in self._adapters.values() if a.pins),
            waste_fraction=round(waste, 6),
            cached_pages=self.prefixes.idle_count(),
        )

    def check_invariants(self) -> None:
        """Every page is free, idle cached or owned exactly once (a KV page by every sequence that counts
        on it); raises AssertionError otherwise (tests use it)."""
        holders: dict[int, int] = {}
        for pages in self._kv.values():
            for page in pages:
                holders[page] = holders.get(page, 0) + 1
        if holders != self._refs:
            raise AssertionError("KV page reference counts disagree with the sequences holding them")
        owned = list(self._refs) + [p for a in self._adapters.values() for p in a.pages]
        everything = owned + self._free + self.prefixes.idle_pages()
        self.prefixes.check_invariants()
        if sorted(everything) != list(range(self.layout.num_pages)):
            raise AssertionError("a page is owned twice, leaked, or out of range")
        for seq, pages in self._kv.items():
            if self.layout.kv_pages_for(self._kv_tokens[seq]) != len(pages):
                raise AssertionError(f"sequence {seq!r} holds {len(pages)} pages for {self._kv_tokens[seq]} tokens")
