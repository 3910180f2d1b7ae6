"""A worker's adapters in host RAM are an LRU cache with a byte budget.

The registry is a plain object, tested directly: versions no request holds are evicted least
recently used first once the budget is passed; held versions never are; an evicted version is
simply unknown (the worker fetches it from the store again). The loader's background copy keeps
its own reference, so evicting an adapter mid-prefetch cannot break the copy.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from loraserve.errors import AdapterNotFoundError, InvalidConfigError
from loraserve.worker.adapter_cache import AdapterRegistry
from loraserve.worker.adapters import LoraAdapter
from loraserve.worker.cli import add_engine_arguments, add_generate_arguments, engine_config_from_args
from loraserve.worker.config import EngineConfig

MB = 2**20


def _adapter(nbytes: int) -> LoraAdapter:
    a = torch.zeros(nbytes // 8, dtype=torch.float32)  # A and B of nbytes / 2 each
    return LoraAdapter(4, 8.0, False, ("q_proj",), (0,), {(0, "q_proj"): (a, a.clone())}, {})


def test_unbudgeted_registry_keeps_everything():
    registry = AdapterRegistry()
    for i in range(20):
        registry.register(f"a{i}", _adapter(MB), version=1)
    assert all(registry.has((f"a{i}", 1)) for i in range(20))
    assert registry.evictions == 0 and registry.nbytes == 20 * MB


def test_least_recently_used_unheld_versions_are_evicted_past_the_budget():
    registry = AdapterRegistry(budget_bytes=3 * MB)
    for name in ("a", "b", "c"):
        registry.register(name, _adapter(MB), version=1)
    registry.hold(("a", 1))  # a is now the most recently used (and pinned)
    registry.release(("a", 1))
    registry.register("d", _adapter(MB), version=1)
    assert not registry.has(("b", 1))  # the least recently used
    assert [registry.has((n, 1)) for n in "acd"] == [True, True, True]
    assert registry.nbytes == 3 * MB and registry.evictions == 1
    with pytest.raises(AdapterNotFoundError):
        registry.latest("b")  # unknown until fetched again
    registry.register("b", _adapter(MB), version=1)  # fetched again from the store
    assert registry.has(("b", 1)) and not registry.has(("c", 1))


def test_held_versions_are_never_evicted_and_the_cache_comes_back_under_budget_on_release():
    registry = AdapterRegistry(budget_bytes=2 * MB)
    for name in ("a", "b"):
        registry.register(name, _adapter(MB), version=1)
        registry.hold((name, 1))
    registry.register("c", _adapter(MB), version=1)  # everything else is held: over budget for now
    assert all(registry.has((n, 1)) for n in "abc") and registry.nbytes == 3 * MB
    registry.release(("a", 1))
    assert not registry.has(("a", 1)) and registry.nbytes == 2 * MB
    registry.get(("b", 1))  # still usable by its request


def test_an_adapter_larger_than_the_budget_is_still_served():
    registry = AdapterRegistry(budget_bytes=MB)
    key = registry.register("big", _adapter(4 * MB), version=1)
    assert registry.has(key)  # kept while it is the newest; evicted by the next registration
    registry.register("small", _adapter(MB // 2), version=1)
    assert not registry.has(key)


def test_re_registering_a_held_version_keeps_its_holders():
    registry = AdapterRegistry(budget_bytes=MB)
    registry.register("a", _adapter(MB), version=1)
    registry.hold(("a", 1))
    registry.register("a", _adapter(MB), version=1)
    registry.register("b", _adapter(MB), version=1)
    assert registry.has(("a", 1))
    registry.release(("a", 1))


def test_the_worker_flag_has_a_default_budget_and_generate_keeps_every_adapter():
    worker = argparse.ArgumentParser()
    add_engine_arguments(worker)
    config = engine_config_from_args(worker.parse_args(["--adapter-cache-gb", "0.5"]))
    assert config.adapter_cache_bytes == 2**29
    assert engine_config_from_args(worker.parse_args([])).adapter_cache_bytes == 4 * 2**30
    offline = argparse.ArgumentParser()
    add_generate_arguments(offline)
    assert engine_config_from_args(offline.parse_args(["hi"])).adapter_cache_bytes is None
    with pytest.raises(InvalidConfigError, match="adapter_cache_bytes"):
        EngineConfig(adapter_cache_bytes=-1)


def test_an_engine_with_a_small_cache_evicts_and_serves_refetched_adapters(tiny_model, tiny_adapters):
    from loraserve.worker.engine import Engine, GenerateRequest
    from loraserve.worker.sampling import SamplingParams

    engine = Engine(tiny_model, EngineConfig(device="cpu", pool_pages=256, max_batch_size=4))
    engine.registry.budget_bytes = 1  # what Engine(config with adapter_cache_bytes=1) sets up
    names = list(tiny_adapters)
    sampling = SamplingParams(max_new_tokens=3)
    try:
        for round_ in range(2):
            for name in names:  # each registration evicts the one before (none is held between batches)
                key = engine.register_adapter(name, tiny_adapters[name], version=round_ + 1)
                engine.adapters.prefetch([key])  # a background copy that must survive the next eviction
            assert [engine.registry.has((n, round_ + 1)) for n in names] == [False] * (len(names) - 1) + [True]
            last = (names[-1], round_ + 1)
            [result] = engine.generate([GenerateRequest(prompt_ids=[1, 2, 3], adapter=last, sampling=sampling)])
            assert result.error is None and len(result.token_ids) == 3
        assert engine.registry.evictions >= 2 * len(names) - 1
    finally:
        engine.close()
