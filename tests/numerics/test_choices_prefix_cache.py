"""n choices of one prompt with prefix caching on: the members of a prefill group attach the donor's
cached full pages (shared, not copied) and copy only the partial page that holds the rest of the prompt.

The prompt is 41 tokens: two full pages of 16 and 9 tokens more. The first member (the donor) computes
it and its two full pages enter the cache; each other member then finds them cached (32 tokens), copies
the third page from the donor (tokens 32..39) and computes only the last prompt token. Every output
token's log-probability is checked against transformers + peft (tolerance 1e-4, as test_logprobs.py),
so a page shared or copied wrong would show.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import hf_sequence_logits

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine
from loraserve.worker.sampling import SamplingParams

TOL = 1e-4
PER_PAGE = 16
PROMPT = [1] + [random.Random(3).randrange(3, 1000) for _ in range(40)]  # 41 tokens: 2 full pages + 9
N = 3


def _run_group() -> tuple[Engine, list, list[tuple[int, int]], dict[str, list[int]]]:
    """The engine, its N requests of one group, every KV page copy, and each request's page table
    as it was once all were admitted."""
    engine = Engine(DEMO_MODEL_DIR, EngineConfig(device="cpu", pool_pages=128, prefix_cache=True))
    engine.register_adapter("upper", demo_adapters()["upper"])
    copies: list[tuple[int, int]] = []
    execute = engine.runner.execute

    def spy(batch, kv_copies):
        copies.extend(kv_copies)
        return execute(batch, kv_copies)

    engine.runner.execute = spy
    sampling = [
        SamplingParams(max_new_tokens=4, temperature=1.0, seed=s, ignore_eos=True, logprobs=0) for s in range(N)
    ]
    requests = [engine.add_request(PROMPT, s, "upper", f"r{i}", group="g") for i, s in enumerate(sampling)]
    tables: dict[str, list[int]] = {}
    while engine.has_unfinished():
        engine.step()
        if not tables and len(engine.step_scheduler.running) == N:
            tables = {r.request_id: list(engine.pool.pages.kv_page_table(r.request_id)) for r in requests}
    return engine, requests, copies, tables


def test_members_attach_the_donors_cached_full_pages_and_copy_only_the_rest():
    engine, requests, copies, tables = _run_group()
    donor, *members = requests
    full = (len(PROMPT) - 1) // PER_PAGE  # pages whose KV is cached: 2
    assert [r.cached_tokens for r in requests] == [0] + [full * PER_PAGE] * (N - 1)
    for member in members:  # the same pages, not copies of them
        assert tables[member.request_id][:full] == tables[donor.request_id][:full]
    donor_partial = tables[donor.request_id][full]
    assert sorted(copies) == sorted((donor_partial, tables[m.request_id][full]) for m in members)  # one page each
    path = demo_adapters()["upper"]
    for request in requests:
        ids = request.spec.prompt_ids + request.output_ids
        reference = torch.log_softmax(hf_sequence_logits(DEMO_MODEL_DIR, path, ids), -1)
        for i, (token, entry) in enumerate(zip(request.output_ids, request.logprobs, strict=True)):
            assert entry.logprob == pytest.approx(reference[len(PROMPT) + i - 1, token].item(), abs=TOL), i
    engine.close()


def test_each_prompt_token_not_computed_is_counted_once():
    engine, requests, _, _ = _run_group()
    # a member computes only the last prompt token: the others were found cached or copied, each counted once
    assert [r.cached_tokens + r.shared_prefill_tokens for r in requests] == [0] + [len(PROMPT) - 1] * (N - 1)
    scheduler = engine.step_scheduler
    assert scheduler.cached_tokens + scheduler.shared_prefill_tokens == (N - 1) * (len(PROMPT) - 1)
    engine.close()
