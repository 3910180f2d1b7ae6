"""UnifiedPool: the one owner of the pool tensor, its pages, resident adapters, pins and copies.

Real demo adapters on the demo model's geometry: what `ensure` and `prefetch` copy in is exactly
what `LoraAdapter.pack` lays out, evicting forgets the slot in the same call (no second place to
keep in step), pins and background copies protect pages, stale versions go, and the eviction
policy is pluggable.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.model_config import ModelConfig
from loraserve.worker.adapter_cache import AdapterRegistry
from loraserve.worker.adapters import load_adapter_dir
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.unified_pool import UnifiedPool

MODEL = ModelConfig.from_dir(DEMO_MODEL_DIR)
NAMES = ("snake", "novowel", "title")  # 76, 62 and 14 pages of 8 rows: the pool holds the first two


class MostRecentlyUsed:
    def victims(self, candidates):
        return list(reversed(candidates))


def _pool(policy=None) -> tuple[UnifiedPool, AdapterRegistry, list]:
    """A pool exactly as large as the first two adapters: the third fits only by evicting one."""
    registry = AdapterRegistry()
    keys = [registry.register(n, load_adapter_dir(demo_adapters()[n], MODEL, 64)) for n in NAMES]
    probe = PoolLayout.for_model(MODEL, 8, 1)
    pages = [registry.get(k).layout(probe, MODEL).num_pages for k in keys]
    layout = PoolLayout.for_model(MODEL, 8, pages[0] + pages[1])
    return UnifiedPool(layout, MODEL, registry, torch.float32, torch.device("cpu"), policy=policy), registry, keys


def _rows_hold(pool: UnifiedPool, registry: AdapterRegistry, key) -> bool:
    packed = registry.get(key).pack(pool.layout, MODEL, torch.float32)
    return torch.equal(pool.tensor.index_select(1, pool.slot(key).row_index), packed)


def test_ensure_copies_exactly_the_packed_rows_and_eviction_forgets_the_slot_at_once():
    pool, registry, (a, b, c) = _pool()
    assert pool.ensure(a) and pool.ensure(b)
    assert _rows_hold(pool, registry, a) and _rows_hold(pool, registry, b)
    assert pool.stats.misses == 2
    assert pool.ensure(c)  # full: the least recently used (a) goes
    assert not pool.pages.is_resident(a) and pool.pages.resident_adapters() == [b, c]
    with pytest.raises(KeyError):
        pool.slot(a)
    assert _rows_hold(pool, registry, c) and pool.stats.evictions == 1
    pool.check_invariants()


def test_pinned_and_kept_adapters_are_never_evicted():
    pool, _, (a, b, c) = _pool()
    pool.ensure(a)
    pool.ensure(b)
    pool.pages.pin(a)
    assert not pool.ensure(c, keep=frozenset({b}))  # a is pinned, b is kept: no room
    assert pool.pages.resident_adapters() == [b, a]
    pool.pages.unpin(a)
    assert pool.ensure(c, keep=frozenset({b}))
    assert pool.pages.resident_adapters() == [b, c]
    pool.check_invariants()


def test_the_eviction_policy_is_pluggable():
    pool, _, (a, b, c) = _pool(policy=MostRecentlyUsed())
    pool.ensure(a)
    pool.ensure(b)
    pool.ensure(c)
    assert pool.pages.resident_adapters() == [a, c]  # the most recently used (b) went


def test_a_prefetch_is_pinned_until_its_copy_settles_and_counts_as_a_hit():
    pool, registry, (a, b, c) = _pool()
    assert pool.prefetch([a], reserve_pages=0) == [a]
    assert pool.copying()
    assert pool.wait_ready(a) >= 0.0 and pool.stats.prefetch_hits + pool.stats.prefetch_late == 1
    assert _rows_hold(pool, registry, a)
    pool.settle()
    assert not pool.copying()
    pool.ensure(b)
    assert pool.ensure(c) and not pool.pages.is_resident(a)  # unpinned after settle: evictable again
    pool.copier.close()


def test_a_stale_version_leaves_the_pool_only_when_nothing_pins_it():
    pool, registry, (a, _, _) = _pool()
    pool.ensure(a)
    pool.pages.pin(a)
    newer = registry.register(a[0], registry.get(a))
    pool.discard_stale(a)
    assert pool.pages.is_resident(a)  # a running request still reads it
    pool.pages.unpin(a)
    pool.discard_stale(a)
    assert not pool.pages.is_resident(a)
    pool.discard_stale(newer)  # the current version is never discarded
    pool.ensure(newer)
    pool.discard_stale(newer)
    assert pool.pages.is_resident(newer)
    pool.check_invariants()


def test_kv_takes_pages_from_idle_adapters_only_through_make_room():
    pool, _, (a, b, _) = _pool()
    pool.ensure(a)
    pool.ensure(b)
    tokens = pool.layout.tokens_per_page
    assert not pool.pages.grow_kv("seq", tokens)  # grow_kv never evicts
    assert pool.make_room(1, keep=frozenset({b}), for_kv=True)
    assert pool.pages.grow_kv("seq", tokens) and not pool.pages.is_resident(a) and pool.pages.is_resident(b)
    pool.pages.free_kv("seq")
    pool.check_invariants()


def test_contiguous_runs_join_consecutive_pages_and_stop_at_the_adapters_rows():
    from loraserve.worker.pool_copier import contiguous_runs

    # pages 3, 4, 5 are consecutive (rows 6..11), page 9 stands alone; 7 rows of 2 per page fill 4 pages
    assert contiguous_runs((3, 4, 5, 9), rows_per_page=2, num_rows=7) == [(6, 0, 6), (18, 6, 1)]
    assert contiguous_runs((5, 4), rows_per_page=2, num_rows=4) == [(10, 0, 2), (8, 2, 2)]  # not in order: two
    assert contiguous_runs((1, 2, 3), rows_per_page=4, num_rows=4) == [(4, 0, 4)]  # the later pages hold no rows
