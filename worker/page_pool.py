"""Who owns which page of the unified pool: sequences' KV cache and resident adapters.

A pure bookkeeping object (no tensors), private to `UnifiedPool` (unified_pool.py), which owns the
tensor and copies the data. There is no static split between KV and adapters — both draw from one
free list. Adapters stay resident while unused and are evicted only when someone needs their
pages, in the order an `EvictionPolicy` chooses (least recently used by default); an adapter
pinned by a running request or an in-flight copy is never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol

from loraserve.worker.pool_layout import PoolLayout


@dataclass(frozen=True)
class PoolStats:
    total_pages: int
    free_pages: int
    kv_pages: int
    adapter_pages: int
    resident_adapters: int
    pinned_adapters: int
    waste_fraction: float  # 1 - useful elements / elements of allocated pages (padding, partial pages)

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
        return sum(len(p) for p in self._kv.values())

    def _adapter_used(self) -> int:
        return sum(len(a.pages) for a in self._adapters.values())

    def room(self, for_kv: bool) -> int:
        """Free pages KV (or adapters) may take now."""
        if not self.split:
            return len(self._free)
        if for_kv:
            return self.layout.num_pages - self.adapter_cap - self._kv_used()
        return self.adapter_cap - self._adapter_used()

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
        pages.extend(self._free.pop() for _ in range(need))
        self._kv_tokens[seq] = max(self._kv_tokens.get(seq, 0), num_tokens)
        return True

    def free_kv(self, seq: Hashable) -> int:
        """Return every page of `seq`; returns how many."""
        pages = self._kv.pop(seq, [])
        self._kv_tokens.pop(seq, None)
        self._free.extend(reversed(pages))
        return len(pages)

    # ---- adapters ------------------------------------------------------------------------------
    def allocate_adapter(self, key: Hashable, num_pages: int, useful_elements: int) -> list[int] | None:
        """Pages for a new resident adapter, or None if there are not enough free pages (never evicts)."""
        if key in self._adapters:
            raise ValueError(f"adapter {key!r} is already resident")
        if num_pages > self.room(for_kv=False):
            return None
        pages = [self._free.pop() for _ in range(num_pages)]
        self._adapters[key] = _Adapter(pages, useful_elements)
        return pages

    def touch(self, key: Hashable) -> None:
        """Mark a resident adapter as just used (moves it to the back of the LRU order)."""
        self._adapters.move_to_end(key)

    def pin(self, key: Hashable) -> None:
        self._adapters[key].pins += 1
        self.touch(key)

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
        kv_pages = sum(len(p) for p in self._kv.values())
        adapter_pages = sum(len(a.pages) for a in self._adapters.values())
        kv_useful = sum(self._kv_tokens.values()) * 2 * layout.row_width * layout.num_layers
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
        )

    def check_invariants(self) -> None:
        """Every page is free or owned exactly once; raises AssertionError otherwise (tests use it)."""
        owned = [p for pages in self._kv.values() for p in pages]
        owned += [p for a in self._adapters.values() for p in a.pages]
        everything = owned + self._free
        if sorted(everything) != list(range(self.layout.num_pages)):
            raise AssertionError("a page is owned twice, leaked, or out of range")
        for seq, pages in self._kv.items():
            if self.layout.kv_pages_for(self._kv_tokens[seq]) != len(pages):
                raise AssertionError(f"sequence {seq!r} holds {len(pages)} pages for {self._kv_tokens[seq]} tokens")
