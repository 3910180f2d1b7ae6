"""The unified page pool's bookkeeping under random operation sequences (hypothesis state machine)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loraserve.model_config import ModelConfig
from loraserve.worker.page_pool import PagePool
from loraserve.worker.pool_layout import PoolLayout

NUM_PAGES = 24


class PoolMachine(RuleBasedStateMachine):
    """Drives a PagePool and a trivially correct model of it side by side."""

    ADAPTER_CAP: int | None = None  # None: unified pool; else adapters are capped (split pool)

    def __init__(self):
        super().__init__()
        self.layout = PoolLayout(num_layers=2, row_width=8, rows_per_page=4, num_pages=NUM_PAGES)
        self.pool = PagePool(self.layout, self.ADAPTER_CAP)
        self.seq_tokens: dict[int, int] = {}  # model: sequence -> tokens it holds room for
        self.adapters: dict[str, int] = {}  # model: resident adapter -> pages
        self.pins: dict[str, int] = {}
        self.lru: list[str] = []  # least recently used first

    def _free_model(self) -> int:
        return NUM_PAGES - self._kv_model() - sum(self.adapters.values())

    def _kv_model(self) -> int:
        return sum(self.layout.kv_pages_for(t) for t in self.seq_tokens.values())

    def _room(self, for_kv: bool) -> int:
        if self.ADAPTER_CAP is None:
            return self._free_model()
        if for_kv:
            return NUM_PAGES - self.ADAPTER_CAP - self._kv_model()
        return self.ADAPTER_CAP - sum(self.adapters.values())

    @rule(seq=st.integers(0, 5), tokens=st.integers(1, 40))
    def grow_kv(self, seq, tokens):
        have = self.seq_tokens.get(seq, 0)
        target = max(have, tokens)
        need = self.layout.kv_pages_for(target) - self.layout.kv_pages_for(have)
        ok = self.pool.grow_kv(seq, target)
        assert ok == (need <= self._room(for_kv=True))
        if ok:
            self.seq_tokens[seq] = target

    @rule(seq=st.integers(0, 5))
    def free_kv(self, seq):
        freed = self.pool.free_kv(seq)
        assert freed == self.layout.kv_pages_for(self.seq_tokens.pop(seq, 0))

    @rule(name=st.sampled_from("abcdef"), pages=st.integers(1, 6))
    def load_adapter(self, name, pages):
        if name in self.adapters:
            with pytest.raises(ValueError):
                self.pool.allocate_adapter(name, pages, 1)
            return
        free = set(self.pool._free)
        run_is_free = any(all(p + i in free for i in range(pages)) for p in free)
        got = self.pool.allocate_adapter(name, pages, pages * 10)
        if pages <= self._room(for_kv=False):
            assert got is not None and len(got) == pages
            if run_is_free:  # an adapter lies on consecutive pages wherever it can (read in place by LoRA)
                assert got == list(range(got[0], got[0] + pages))
            self.adapters[name] = pages
            self.pins[name] = 0
            self.lru.append(name)
        else:
            assert got is None

    @precondition(lambda self: self.adapters)
    @rule(data=st.data())
    def pin(self, data):
        name = data.draw(st.sampled_from(sorted(self.adapters)))
        self.pool.pin(name)
        self.pins[name] += 1
        self.lru.remove(name)
        self.lru.append(name)

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        name = data.draw(st.sampled_from(sorted(n for n, p in self.pins.items() if p)))
        self.pool.unpin(name)
        self.pins[name] -= 1

    @precondition(lambda self: self.adapters)
    @rule(data=st.data())
    def free_adapter(self, data):
        name = data.draw(st.sampled_from(sorted(self.adapters)))
        if self.pins[name]:
            with pytest.raises(ValueError):
                self.pool.free_adapter(name)
            return
        self.pool.free_adapter(name)
        self._forget(name)

    def _forget(self, name):
        del self.adapters[name], self.pins[name]
        self.lru.remove(name)

    @rule(
        pages=st.integers(0, NUM_PAGES + 2),
        keep=st.sets(st.sampled_from("abcdef"), max_size=2),
        for_kv=st.booleans(),
    )
    def evict_for(self, pages, keep, for_kv):
        free = self._room(for_kv)
        candidates = [n for n in self.lru if not self.pins[n] and n not in keep]
        evicted = self.pool.evict_for(pages, frozenset(keep), for_kv=for_kv)
        if pages <= free:
            assert evicted == []
        elif self.ADAPTER_CAP is not None and for_kv:
            assert evicted is None  # a split pool never trades adapter pages for KV
        elif free + sum(self.adapters[n] for n in candidates) < pages:
            assert evicted is None
        else:
            # least recently used first, and no more than needed
            expected, short = [], pages - free
            for name in candidates:
                if short <= 0:
                    break
                expected.append(name)
                short -= self.adapters[name]
            assert evicted == expected
            for name in expected:
                self._forget(name)

    @invariant()
    def accounting_is_exact(self):
        self.pool.check_invariants()
        stats = self.pool.stats()
        assert stats.free_pages == self._free_model()
        assert stats.kv_pages == sum(self.layout.kv_pages_for(t) for t in self.seq_tokens.values())
        assert stats.adapter_pages == sum(self.adapters.values())
        assert stats.free_pages + stats.kv_pages + stats.adapter_pages == NUM_PAGES
        assert stats.pinned_adapters == sum(1 for p in self.pins.values() if p)
        assert self.pool.resident_adapters() == self.lru
        assert 0.0 <= stats.waste_fraction < 1.0


class SplitPoolMachine(PoolMachine):
    ADAPTER_CAP = 9


for machine in (PoolMachine, SplitPoolMachine):
    machine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestUnifiedPool = PoolMachine.TestCase
TestSplitPool = SplitPoolMachine.TestCase


def _config(hidden=4096, kv_heads=8, heads=32, intermediate=14336) -> ModelConfig:
    return ModelConfig.from_hf(
        {
            "model_type": "llama",
            "vocab_size": 32000,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
        }
    )


@pytest.mark.parametrize(
    ("config", "expected_waste"),
    [
        (_config(), 0.0),  # Llama-3-8B shapes: 14336 = 14 x 1024, nothing padded
        (
            _config(kv_heads=32, intermediate=11008),
            1 - 78080 / 81920,
        ),  # Llama-2-7B: MLP rows padded 11008 -> 12288
    ],
)
def test_adapter_layout_wastes_little_with_gqa_and_mlp(config, expected_waste):
    layout = PoolLayout.for_model(config, rows_per_page=32, num_pages=100)
    adapter = layout.adapter_layout(
        config, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )
    stored = adapter.num_rows * layout.row_width * layout.num_layers
    padding_waste = 1 - adapter.useful_elements / stored
    assert padding_waste == pytest.approx(expected_waste)
    # KV of grouped-query attention: one row per token per K/V, exactly the KV width
    assert layout.row_width == config.kv_width


def test_kv_pages_and_waste_accounting():
    layout = PoolLayout(num_layers=2, row_width=8, rows_per_page=4, num_pages=10)  # 2 tokens per page
    pool = PagePool(layout)
    assert pool.grow_kv("s", 3)  # 2 pages, 3 of 4 token slots used
    assert pool.kv_page_table("s") == [0, 1]
    stats = pool.stats()
    assert stats.kv_pages == 2 and stats.free_pages == 8
    assert stats.waste_fraction == pytest.approx(1 - 3 / 4)
    assert not pool.grow_kv("t", 100)  # all or nothing
    assert pool.stats().free_pages == 8


def test_an_adapter_takes_the_highest_free_run_of_pages_and_kv_the_lowest_pages():
    layout = PoolLayout(num_layers=1, row_width=8, rows_per_page=4, num_pages=12)
    pool = PagePool(layout)
    for seq in range(6):  # KV on pages 0-5, then every other one freed: 0, 2, 4 free among them
        assert pool.grow_kv(seq, layout.tokens_per_page)
    for seq in (0, 2, 4):
        pool.free_kv(seq)
    assert pool.allocate_adapter("a", 3, 1) == [9, 10, 11]
    assert pool.allocate_adapter("b", 4, 1) is not None  # no run of 4 is free: any 4 pages
    assert pool.grow_kv(6, layout.tokens_per_page) and pool.kv_page_table(6)[0] not in (9, 10, 11)
    pool.check_invariants()
