"""Prefetch that hits, never at the cost of a likelier adapter.

Real parts throughout: the demo model and its adapters, the unified pool, the engine, and for the
last test a worker and an adapter store as child processes.

- The pool: a prefetch takes free pages, or pages of idle adapters scored strictly lower than the
  one it fetches (scores the scheduler sent, NEEDED for queued requests, UNKNOWN_SCORE otherwise);
  a request's own load still evicts by LRU; a copy for requests already waiting on a fetch is a
  miss, not a hit. `prepare` packs an adapter off the step loop, so that a load copies exactly the
  rows `pack` would make, without packing them.
- The engine: a scripted workload where every predicted adapter's load must be a prefetch hit
  (hints sent before the requests arrive, and adapters of queued requests), the same workload
  with prefetch off (no hits: this fails if prefetch is disabled or broken), and token-identical
  outputs either way, greedy and seeded sampling.
- A worker process: a PREFETCH makes its next reports list the adapter resident before any request
  for it arrives, and the request's load then counts as a prefetch hit.
"""

from __future__ import annotations

import time

import pytest
import torch

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.model_config import ModelConfig
from loraserve.worker.adapter_cache import AdapterRegistry
from loraserve.worker.adapters import load_adapter_dir
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.sampling import SamplingParams
from loraserve.worker.unified_pool import UnifiedPool

MODEL = ModelConfig.from_dir(DEMO_MODEL_DIR)
NAMES = ("snake", "novowel", "title")  # 76, 62 and 14 pages of 8 rows


def _pool(extra_pages: int = 0) -> tuple[UnifiedPool, list]:
    """A pool as large as the first two adapters (+ `extra_pages`): the third fits only by evicting one."""
    registry = AdapterRegistry()
    keys = [registry.register(n, load_adapter_dir(demo_adapters()[n], MODEL, 64)) for n in NAMES]
    probe = PoolLayout.for_model(MODEL, 8, 1)
    pages = [registry.get(k).layout(probe, MODEL).num_pages for k in keys]
    layout = PoolLayout.for_model(MODEL, 8, pages[0] + pages[1] + extra_pages)
    return UnifiedPool(layout, MODEL, registry, torch.float32, torch.device("cpu")), keys


def _full_pool() -> tuple[UnifiedPool, list]:
    """a and b resident (a the least recently used), no free page; c is not resident."""
    pool, (a, b, c) = _pool()
    assert pool.ensure(a) and pool.ensure(b) and pool.pages.stats().free_pages == 0
    return pool, [a, b, c]


def test_a_prefetch_takes_free_pages_and_evicts_nothing_while_there_are_some():
    pool, (a, _, c) = _pool(extra_pages=14)
    pool.ensure(a)
    assert pool.prefetch([c], reserve_pages=0) == [c]  # unscored: UNKNOWN_SCORE, like a
    assert pool.stats.evictions == 0 and pool.pages.resident_adapters() == [a, c]
    pool.copier.close()


def test_a_prefetch_never_evicts_an_adapter_scored_higher_or_equal():
    pool, (a, b, c) = _full_pool()
    pool.remember_scores([(a, 0.9), (b, 0.5), (c, 0.5)])
    assert pool.prefetch([c], reserve_pages=0) == []  # b is as likely as c: kept
    assert pool.pages.resident_adapters() == [a, b] and pool.stats.evictions == 0
    pool.remember_scores([(c, 0.6)])  # the latest score counts
    assert pool.prefetch([c], reserve_pages=0) == [c]
    assert pool.pages.resident_adapters() == [a, c]  # b went, although a was used less recently
    pool.check_invariants()
    pool.copier.close()


def test_unscored_adapters_are_evicted_only_for_likelier_ones_or_queued_requests():
    pool, (_, b, c) = _full_pool()
    assert pool.prefetch([c], reserve_pages=0) == []  # unknown against unknown: nothing evicted
    pool.remember_scores([(c, 0.4)])
    assert pool.prefetch([c], reserve_pages=0) == []
    assert pool.prefetch([c], reserve_pages=0, needed=frozenset({c})) == [c]  # a queued request needs it
    assert pool.pages.resident_adapters() == [b, c]  # NEEDED outranks everything: the LRU idle one went
    pool.copier.close()


def test_an_adapter_a_queued_request_needs_is_never_evicted_for_a_hint():
    pool, (a, b, c) = _full_pool()
    pool.remember_scores([(c, 1.0)])
    assert pool.prefetch([c], reserve_pages=0, needed=frozenset({a, b})) == []
    assert pool.pages.resident_adapters() == [a, b]
    pool.copier.close()


def test_a_requests_own_load_still_evicts_the_least_recently_used():
    pool, (a, b, c) = _full_pool()
    pool.remember_scores([(a, 1.0), (b, 1.0), (c, 0.0)])
    assert pool.ensure(c) and pool.pages.resident_adapters() == [b, c]
    pool.copier.close()


def test_a_background_copy_for_requests_already_waiting_is_a_miss_not_a_prefetch_hit():
    pool, (a, b, _) = _pool()
    assert pool.prefetch([a], reserve_pages=0, demand=True) == [a]  # fetched for requests parked on it
    assert pool.prefetch([b], reserve_pages=0) == [b]  # predicted
    pool.wait_ready(a)
    pool.wait_ready(b)
    s = pool.stats
    assert (s.misses, s.prefetches, s.prefetch_hits + s.prefetch_late, s.loads) == (1, 1, 1, 2)
    pool.copier.close()


def test_prepare_packs_off_the_copy_path_and_the_copy_holds_exactly_the_packed_rows():
    pool, (a, _, _) = _pool()
    adapter = pool.host.get(a)
    prepared = pool.copier.prepare(adapter)
    expected = adapter.pack(pool.layout, MODEL, torch.float32)
    assert prepared.rows(pool.layout, MODEL, torch.float32) is prepared.packed  # no packing at load time
    assert torch.equal(prepared.packed, expected) and prepared == adapter
    assert prepared.nbytes == adapter.nbytes + expected.nbytes  # the host cache's budget sees both
    key = pool.host.register(a[0], prepared)
    assert pool.ensure(key)
    assert torch.equal(pool.tensor.index_select(1, pool.slot(key).row_index), expected)
    other = PoolLayout.for_model(MODEL, 8, 4)
    assert torch.equal(prepared.rows(other, MODEL, torch.float64), adapter.pack(other, MODEL, torch.float64))
    pool.copier.close()


# ---- the engine: a scripted workload ----------------------------------------------------------
HINTED = ("rot13", "reverse")  # the scheduler predicts these before their requests arrive
QUEUED = ("title", "snake", "novowel")  # requests queued behind a full batch
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.9, top_p=0.95, seed=11)


def _settle(engine: Engine, timeout_s: float = 10.0) -> None:
    """Let background copies finish, so that a hit is a hit and never `prefetch_late` (timing)."""
    deadline = time.monotonic() + timeout_s
    engine.pool.settle()
    while engine.pool.copying():
        assert time.monotonic() < deadline, "a background copy did not finish"
        time.sleep(0.002)
        engine.pool.settle()


def _run(engine: Engine, tokens: dict[str, list[int]], steps: int | None = None) -> None:
    """Step `engine` (until nothing is left, or `steps` times), settling copies between steps;
    collects each request's tokens into `tokens`."""
    while engine.has_unfinished() and (steps is None or steps > 0):
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        _settle(engine)
        steps = None if steps is None else steps - 1


def _workload(prefetch: bool, sampling: SamplingParams) -> tuple[dict[str, list[int]], dict]:
    """upper runs; rot13 and reverse are hinted, then requested; three more queue behind a batch of 2."""
    config = EngineConfig(device="cpu", pool_pages=160, max_batch_size=2, prefetch=prefetch, seed=3)
    engine = Engine(DEMO_MODEL_DIR, config)
    try:
        for name, path in demo_adapters().items():
            engine.register_adapter(name, path)
        prompt = engine.tokenizer.encode("the quiet king")
        tokens: dict[str, list[int]] = {}
        engine.add_request(prompt, sampling, "upper", "upper-0")
        _run(engine, tokens, steps=1)  # upper is loaded (a miss: nobody predicted it) and running
        engine.adapters.prefetch(list(HINTED), scores=[0.9, 0.8])  # a PREFETCH from the scheduler
        _run(engine, tokens)
        for name in HINTED:
            engine.add_request(prompt, sampling, name, f"{name}-0")
        _run(engine, tokens)
        for name in QUEUED:  # 2 run, 1 waits: its adapter is copied in while they decode
            engine.add_request(prompt, sampling, name, f"{name}-0")
        _run(engine, tokens)
        return tokens, engine.stats()["adapters"]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def workloads() -> dict[tuple[bool, str], tuple[dict[str, list[int]], dict]]:
    return {
        (p, s): _workload(p, sampling)
        for p in (True, False)
        for s, sampling in [("greedy", GREEDY), ("seeded", SEEDED)]
    }


def test_predicted_adapters_are_prefetch_hits_and_never_cold_loads_on_the_step_path(workloads):
    _, stats = workloads[True, "greedy"]
    # upper, title and snake were requested before anyone predicted them (the batch had room).
    assert stats["misses"] == 3, stats
    assert stats["prefetch_hits"] == 3 and stats["prefetch_late"] == 0, stats  # rot13, reverse, novowel
    assert stats["prefetches"] == 3 and stats["evictions"] == 0, stats


def test_without_prefetch_the_same_workload_has_no_hits(workloads):
    _, stats = workloads[False, "greedy"]
    assert stats["prefetch_hits"] == 0 and stats["prefetches"] == 0 and stats["misses"] == 6, stats


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_prefetch_never_changes_outputs(workloads, sampling):
    with_prefetch, _ = workloads[True, sampling]
    without, _ = workloads[False, sampling]
    assert set(with_prefetch) == {"upper-0", *(f"{n}-0" for n in HINTED + QUEUED)}
    assert all(len(tokens) == 6 for tokens in with_prefetch.values())
    assert with_prefetch == without


# ---- a worker process --------------------------------------------------------------------------
@pytest.mark.slow
def test_a_prefetch_message_makes_the_adapter_resident_before_its_request_arrives():
    from test_fuzz_live_roles import ADAPTER, WORKER_ID, Roles

    from loraserve.sockets import send
    from loraserve.wire import Prefetch

    roles = Roles()
    try:
        roles.wait_ready()
        key = (ADAPTER, 1)
        send(roles.router, Prefetch([key], [0.9]), to=WORKER_ID.encode())
        deadline = time.monotonic() + 20
        while True:
            report = roles.drain_reports(0.5)
            if report is not None and key in (report.resident or ()):  # None: unchanged (resent every 2 s)
                break
            assert time.monotonic() < deadline, "the prefetched adapter never became resident"
            roles.alive()
        assert not report.running and not report.waiting  # no request for it has arrived
        roles.drain_reports(0.3)  # its background copy (one page) is long done by the next heartbeat
        assert len(roles.generate("after-prefetch")) == 6
        report = roles.drain_reports(1.0) or report
        assert report.prefetch_hits == 1 and report.prefetch_misses == 0, report
    finally:
        roles.close()
