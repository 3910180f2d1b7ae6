"""Prefix caching: full KV pages kept and shared by requests with the same prefix, salt and adapter.

The reference for every output is the same engine with the cache off (`prefix_cache=False`), and
transformers + peft for the log-probabilities of requests that hit (tolerance 1e-4, as
test_logprobs.py): a cached page that held the wrong KV, or was written while shared, would show.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from helpers import hf_sequence_logits
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.prefix_keys import PrefixProbe, adapter_identity, chain_root, extend_chain, is_checkpoint
from loraserve.wire import MAX_PREFIXES
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Cached, Engine
from loraserve.worker.page_pool import PagePool
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.sampling import SamplingParams

TOL = 1e-4
RNG = random.Random(7)
SYSTEM = [1] + [RNG.randrange(3, 1000) for _ in range(69)]  # a 70-token shared prefix: 4 full pages of 16
TURNS = [[RNG.randrange(3, 1000) for _ in range(RNG.randrange(3, 30))] for _ in range(6)]


def _engine(cache: bool = True, **overrides) -> Engine:
    config = EngineConfig(device="cpu", pool_pages=overrides.pop("pool_pages", 160), prefix_cache=cache, **overrides)
    engine = Engine(DEMO_MODEL_DIR, config)
    for name in ("upper", "reverse"):
        engine.register_adapter(name, demo_adapters()[name])
    return engine


def _serve(engine: Engine, waves: list[list[tuple]], **sampling) -> list:
    """Each wave's requests (prompt, adapter, salt, seed) queued together and run to the end, wave after wave."""
    done = []
    for wave in waves:
        added = [
            engine.add_request(
                prompt,
                SamplingParams(max_new_tokens=12, ignore_eos=True, seed=seed, logprobs=0, **sampling),
                adapter,
                cache_salt=salt,
            )
            for prompt, adapter, salt, seed in wave
        ]
        while engine.has_unfinished():
            engine.step()
        engine.pool.check_invariants()
        done += added
    return done


def _waves(adapter=None, salt="t1"):
    first = [(SYSTEM + TURNS[0], adapter, salt, 0)]
    second = [(SYSTEM + turn, adapter, salt, i) for i, turn in enumerate(TURNS[1:])]
    return [first, second]


@pytest.mark.parametrize("adapter", [None, "upper"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hits_are_token_exact_and_peft_exact(adapter, temperature):
    cached = _serve(_engine(), _waves(adapter), temperature=temperature)
    plain = _serve(_engine(cache=False), _waves(adapter), temperature=temperature)
    assert [r.output_ids for r in cached] == [r.output_ids for r in plain]
    assert cached[0].cached_tokens == 0 and all(r.cached_tokens == 64 for r in cached[1:])  # 4 full pages
    assert all(r.cached_tokens == 0 for r in plain)
    path = None if adapter is None else demo_adapters()[adapter]
    for request in cached[1:3]:
        ids = request.spec.prompt_ids + request.output_ids
        reference = torch.log_softmax(hf_sequence_logits(DEMO_MODEL_DIR, path, ids), -1)
        for i, (token, entry) in enumerate(zip(request.output_ids, request.logprobs, strict=True)):
            assert entry.logprob == pytest.approx(
                reference[len(request.spec.prompt_ids) + i - 1, token].item(), abs=TOL
            )


def test_a_conversations_next_turn_reuses_the_last_turns_answer():
    engine = _engine()
    (first,) = _serve(engine, [[(SYSTEM + TURNS[0], "upper", "t", 0)]])
    history = first.spec.prompt_ids + first.output_ids  # the next turn sends the whole conversation again
    (second,) = _serve(engine, [[(history + TURNS[1], "upper", "t", 0)]])
    assert second.cached_tokens == (len(history) // 16) * 16  # every full page, the answer's too
    (plain,) = _serve(_engine(cache=False), [[(history + TURNS[1], "upper", "t", 0)]])
    assert second.output_ids == plain.output_ids


def test_salts_adapters_and_adapter_versions_never_share():
    engine = _engine()
    _serve(engine, [[(SYSTEM + TURNS[0], "upper", "tenant-a", 0)]])
    others = _serve(
        engine,
        [
            [
                (SYSTEM + TURNS[1], "upper", "tenant-b", 0),  # another tenant
                (SYSTEM + TURNS[1], "reverse", "tenant-a", 0),  # another adapter
                (SYSTEM + TURNS[1], None, "tenant-a", 0),  # the base model
            ]
        ],
    )
    assert [r.cached_tokens for r in others] == [0, 0, 0]
    # a new version of the adapter (other weights under the same name) does not meet the old KV
    engine.register_adapter("upper", demo_adapters()["rot13"])
    (fresh,) = _serve(engine, [[(SYSTEM + TURNS[2], "upper", "tenant-a", 0)]])
    assert fresh.cached_tokens == 0
    # nor do other weights under the very same (name, version): the store lost its data and gave the
    # number out again, and the worker's check of the weights' hash replaced them
    key = engine.registry.latest("upper")
    _serve(engine, [[(SYSTEM + TURNS[3], "upper", "tenant-a", 0)]])
    weights = dataclasses.replace(engine.registry.get(engine.registry.latest("reverse")), sha256="ab" * 32)
    assert engine.cached(key, weights.sha256) is Cached.NO
    engine.adapters.add("upper", weights, version=key[1])
    (again,) = _serve(engine, [[(SYSTEM + TURNS[4], "upper", "tenant-a", 0)]])
    assert again.cached_tokens == 0
    reference = _engine(cache=False)
    reference.adapters.add("upper", reference.registry.get(reference.registry.latest("reverse")))
    (plain,) = _serve(reference, [[(SYSTEM + TURNS[4], "upper", "tenant-a", 0)]])
    assert again.output_ids == plain.output_ids


def test_exact_through_preemption_chunked_prefill_and_whole_page_prompts():
    prompts = [SYSTEM + TURNS[i % 3] for i in range(8)] + [SYSTEM[:64], SYSTEM[:64]]  # 64: four whole pages
    waves = [[(p, "upper" if i % 2 else None, "t", i) for i, p in enumerate(prompts)]]
    small = {"pool_pages": 16, "max_batched_tokens": 23, "max_batch_size": 8}  # tight: preemption, odd chunks
    cached = _serve(_engine(**small), waves, temperature=1.0)
    plain = _serve(_engine(cache=False, **small), waves, temperature=1.0)
    assert [r.output_ids for r in cached] == [r.output_ids for r in plain]
    assert sum(r.num_preemptions for r in cached) > 0 and sum(r.cached_tokens for r in cached) > 0
    assert cached[-1].cached_tokens == 48  # a whole-page prompt recomputes its last page (its logits are needed)


def test_prompt_scoring_requests_compute_every_row():
    engine = _engine()
    _serve(engine, [[(SYSTEM + TURNS[0], None, "t", 0)]])
    (scored,) = _serve(engine, [[(SYSTEM + TURNS[1], None, "t", 0)]], prompt_logprobs=1)
    assert scored.cached_tokens == 0 and len(scored.prompt_logprobs) == len(scored.spec.prompt_ids) - 1


def test_cold_cached_pages_go_before_idle_adapters():
    layout = PoolLayout(num_layers=1, row_width=4, rows_per_page=4, num_pages=10)  # 2 tokens a page
    pool = PagePool(layout)
    assert pool.allocate_adapter("a", 3, 1) is not None  # an idle adapter
    pool.grow_kv("s", 8)  # 4 pages
    hashes: list[bytes] = []
    extend_chain(hashes, chain_root("t", ""), list(range(8)), 2)
    for i, block in enumerate(hashes):
        pool.register_kv_page("s", i, block)
    pool.free_kv("s")  # 4 idle cached pages, 3 free
    assert pool.stats().cached_pages == 4 and pool.room(for_kv=True) == 7
    assert pool.evict_for(6) == []  # free + cached pages suffice: the adapter stays
    pool.grow_kv("t", 12)  # 6 pages: the 3 free ones, then the 3 oldest cached
    assert pool.stats().cached_pages == 1 and pool.is_resident("a") and pool.prefixes.evictions == 3
    # a sequence's pages are released last block first, so its tail goes first and its head stays cached
    assert len(pool.prefixes.lookup(hashes)) == 1
    assert pool.evict_for(2) == ["a"]  # only now: the last cached page is not enough
    pool.check_invariants()


class PrefixPoolMachine(RuleBasedStateMachine):
    """Sequences that attach cached prefixes, register their pages and leave, beside adapters that come
    and go: the pool's accounting stays exact and cached pages never outlive their hashes."""

    def __init__(self):
        super().__init__()
        self.layout = PoolLayout(num_layers=1, row_width=4, rows_per_page=4, num_pages=20)
        self.pool = PagePool(self.layout)
        self.live: dict[int, list[bytes]] = {}  # sequence -> its blocks' hashes

    @rule(seq=st.integers(0, 6), prefix=st.integers(0, 2), pages=st.integers(1, 5))
    def start(self, seq, prefix, pages):
        if seq in self.live:
            return
        tokens = [prefix] * 2 * pages  # sequences of one prefix value share blocks
        hashes: list[bytes] = []
        extend_chain(hashes, chain_root("", ""), tokens, 2)
        attached = self.pool.prefixes.lookup(hashes[: pages - 1])
        self.pool.attach_kv(seq, attached)
        if not self.pool.grow_kv(seq, 2 * pages):
            self.pool.free_kv(seq)
            return
        for i in range(len(attached), pages):
            self.pool.register_kv_page(seq, i, hashes[i])
        self.live[seq] = hashes

    @rule(seq=st.integers(0, 6))
    def finish(self, seq):
        self.pool.free_kv(seq)
        self.live.pop(seq, None)

    @rule(name=st.sampled_from("ab"), pages=st.integers(1, 8))
    def adapter(self, name, pages):
        if self.pool.is_resident(name):
            self.pool.free_adapter(name)
        elif self.pool.evict_for(pages) is not None:
            assert self.pool.allocate_adapter(name, pages, 1) is not None

    @invariant()
    def exact(self):
        self.pool.check_invariants()
        stats = self.pool.stats()
        assert stats.free_pages + stats.cached_pages + stats.kv_pages + stats.adapter_pages == 20
        for hashes in self.live.values():  # a live sequence's registered blocks still match
            assert len(self.pool.prefixes.lookup(hashes)) >= 0


PrefixPoolMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None, derandomize=True)
TestPrefixPool = PrefixPoolMachine.TestCase


def test_a_continued_request_finds_its_earlier_attempts_pages_and_goes_on_exactly():
    """Failover and preemption recompute prompt + the tokens already generated: with the cache, the
    full pages of both come from it, and the continuation draws what the first attempt would have."""
    engine = _engine()
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    whole = engine.add_request(SYSTEM + TURNS[0], sampling, "upper", cache_salt="t")
    while not whole.finished:
        engine.step()
    cut = 30
    continued = engine.add_request(
        SYSTEM + TURNS[0], sampling, "upper", output_ids=whole.output_ids[:cut], cache_salt="t"
    )
    while not continued.finished:
        engine.step()
    known = len(whole.spec.prompt_ids) + cut
    assert continued.cached_tokens == (known - 1) // 16 * 16 and continued.output_ids == whole.output_ids


@pytest.mark.parametrize("adapter", [None, "upper"])
def test_the_prefixes_a_worker_reports_are_the_ones_the_scheduler_computes_from_a_prompt(adapter):
    """The scheduler places a request where its prefix is cached by comparing the fingerprints it
    computes from the request's salt, adapter version and tokens with those the worker reports."""
    engine = _engine()
    identity = ""
    if adapter is not None:  # as a worker registers what it fetched: the store's hash of the weights
        weights = dataclasses.replace(engine.registry.get(engine.registry.latest(adapter)), sha256="cd" * 32)
        key = engine.adapters.add("fetched", weights)
        adapter, identity = "fetched", adapter_identity("fetched", key[1], "cd" * 32)
    prompt = SYSTEM + TURNS[0] + TURNS[1]
    (done,) = _serve(engine, [[(prompt, adapter, "tenant-a", 0)]])
    reported = set(engine.pool.pages.prefixes.fingerprints(MAX_PREFIXES))
    history = done.spec.prompt_ids + done.output_ids
    full_pages = len(history) // 16
    longest = max(n for n in range(1, full_pages + 1) if is_checkpoint(n))
    next_turn = PrefixProbe(chain_root("tenant-a", identity), history + TURNS[2])
    assert next_turn.cached_tokens(16, reported) == longest * 16
    assert len(reported) == sum(is_checkpoint(n) for n in range(1, full_pages + 1))
    assert PrefixProbe(chain_root("tenant-b", identity), history + TURNS[2]).cached_tokens(16, reported) == 0
    epoch = engine.pool.pages.prefixes.epoch
    _serve(engine, [[(history + TURNS[2], adapter, "tenant-a", 1)]])  # hits: only its new pages add prefixes
    assert engine.pool.pages.prefixes.epoch > epoch and reported < set(
        engine.pool.pages.prefixes.fingerprints(MAX_PREFIXES)
    )


def test_up_forwards_no_prefix_cache_to_every_worker():
    """On by default; `loraserve up --no-prefix-cache` turns it off on each worker's command line."""
    import argparse

    from loraserve.launcher import commands as launcher
    from loraserve.worker import main as worker_main
    from loraserve.worker.cli import engine_config_from_args

    up, worker = argparse.ArgumentParser(), argparse.ArgumentParser()
    launcher.add_arguments(up)
    worker_main.add_arguments(worker)
    for argv, cache in (([], True), (["--no-prefix-cache"], False)):
        commands = launcher.role_commands(up.parse_args(["--workers", "2", *argv]))
        for name in ("worker-0", "worker-1"):
            line = commands[name]
            assert engine_config_from_args(worker.parse_args(line[line.index("worker") + 1 :])).prefix_cache is cache


def test_the_hit_rate_counts_a_request_once_however_long_it_waited_for_room():
    """A request that waits for pages is looked up at each try, but counted (looked-up and hit tokens)
    only when it is admitted."""
    engine = _engine(pool_pages=16)  # 256 tokens: the second request waits until the first ends
    sampling = SamplingParams(max_new_tokens=16, ignore_eos=True)
    first = engine.add_request(SYSTEM * 3, sampling, None, cache_salt="t")  # 210 + 16 tokens: 15 pages
    second = engine.add_request(TURNS[1] * 4, sampling, None, cache_salt="t")  # 6 pages, nothing shared
    waited = 0
    while engine.has_unfinished():
        engine.step()
        waited += second.first_token is None and first.first_token is not None
    assert waited > 1 and first.num_preemptions == second.num_preemptions == 0
    scheduler = engine.step_scheduler
    assert scheduler.admitted_tokens == len(first.spec.prompt_ids) + len(second.spec.prompt_ids)
    assert scheduler.cached_tokens == 0
