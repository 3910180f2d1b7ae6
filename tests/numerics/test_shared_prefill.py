"""Shared prefill: requests of one group with one prompt and adapter compute the prompt's KV once.

The first member prefills; each other member is admitted with that KV copied into its own pages and
computes only the last prompt token. Checked: how many prompt tokens each step computed, and every
output token's log-probability against transformers + peft (tolerance 1e-4, as test_logprobs.py),
so a copied KV that was wrong by a page or a row would show.
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_sequence_logits

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.sampling import SamplingParams

TOL = 1e-4
PROMPT = "the quiet king finds my little boat and the green queen waits across this gentle tree"


def _engine(**overrides) -> Engine:
    """The prefix cache is off: these tests are about copying a donor's KV (with the cache, a member finds
    the donor's full pages cached and copies only the last partial one: tests/numerics/test_choices_prefix_cache.py)."""
    overrides.setdefault("prefix_cache", False)
    engine = Engine(DEMO_MODEL_DIR, EngineConfig(device="cpu", pool_pages=128, **overrides))
    engine.register_adapter("upper", demo_adapters()["upper"])
    return engine


def _run(engine: Engine, requests: list[GenerateRequest]) -> tuple[list, int]:
    """The results, and the tokens the engine computed over all steps."""
    added = [
        engine.add_request(engine.tokenizer.encode(g.prompt), g.sampling, g.adapter, f"r{i}", group=g.group)
        for i, g in enumerate(requests)
    ]
    computed = 0
    while engine.has_unfinished():
        engine.step()
        computed += engine.last_step.tokens if engine.last_step else 0
    return added, computed


def _check_against_peft(request, adapter: str | None) -> None:
    path = None if adapter is None else demo_adapters()[adapter]
    ids = request.spec.prompt_ids + request.output_ids
    reference = torch.log_softmax(hf_sequence_logits(DEMO_MODEL_DIR, path, ids), -1)
    for i, (token, entry) in enumerate(zip(request.output_ids, request.logprobs, strict=True)):
        assert entry.logprob == pytest.approx(reference[len(request.spec.prompt_ids) + i - 1, token].item(), abs=TOL), i


@pytest.mark.parametrize("adapter", [None, "upper"])
def test_a_group_computes_its_prompt_once(adapter):
    engine = _engine()
    prompt_len = len(engine.tokenizer.encode(PROMPT))
    n, new = 4, 12
    group = [
        GenerateRequest(
            prompt=PROMPT,
            adapter=adapter,
            group="g",
            sampling=SamplingParams(max_new_tokens=new, temperature=1.0, seed=s, ignore_eos=True, logprobs=0),
        )
        for s in range(n)
    ]
    shared, computed = _run(engine, group)
    # the donor's prompt once, each other member's last prompt token, then the decode tokens
    assert computed == prompt_len + (n - 1) + n * (new - 1)
    assert [r.shared_prefill_tokens for r in shared] == [0] + [prompt_len - 1] * (n - 1)
    for request in shared:
        _check_against_peft(request, adapter)
    alone, _ = _run(_engine(), [GenerateRequest(**{**vars(g), "group": None}) for g in group])
    assert [r.output_ids for r in shared] == [r.output_ids for r in alone]  # same seeds, same tokens
    assert len({tuple(r.output_ids) for r in shared}) > 1  # the seeds differ: so do the choices
    engine.close()


def test_members_wait_for_a_chunked_prefill_and_strangers_do_not_share():
    engine = _engine(max_batched_tokens=8)  # the prompt takes several steps
    sampling = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=0)
    requests = [
        GenerateRequest(prompt=PROMPT, group="g", sampling=sampling),
        GenerateRequest(prompt=PROMPT, group="g", sampling=sampling),
        GenerateRequest(prompt=PROMPT, group="h", sampling=sampling),  # another group
        GenerateRequest(prompt=PROMPT, adapter="upper", group="g", sampling=sampling),  # another adapter
        GenerateRequest(prompt=PROMPT + " again", group="g", sampling=sampling),  # another prompt
    ]
    added, _ = _run(engine, requests)
    assert [r.shared_prefill_tokens for r in added] == [0, len(added[0].spec.prompt_ids) - 1, 0, 0, 0]
    assert added[1].output_ids == added[0].output_ids  # greedy: the copy continues exactly as the donor
    for request, g in zip(added, requests, strict=True):
        _check_against_peft(request, g.adapter)
    engine.close()


def test_a_member_whose_donor_is_gone_prefills_on_its_own():
    engine = _engine()
    sampling = SamplingParams(max_new_tokens=3, ignore_eos=True)
    first = engine.add_request(engine.tokenizer.encode(PROMPT), sampling, group="g")
    while not first.finished:
        engine.step()
    late = engine.add_request(engine.tokenizer.encode(PROMPT), sampling, group="g")
    while not late.finished:
        engine.step()
    assert late.shared_prefill_tokens == 0 and late.output_ids == first.output_ids
    engine.close()


def test_prompt_logprobs_are_the_donors():
    engine = _engine()
    sampling = SamplingParams(max_new_tokens=2, prompt_logprobs=2, logprobs=0)
    results = engine.generate([GenerateRequest(prompt=PROMPT, group="g", sampling=sampling) for _ in range(3)])
    assert results[1].prompt_logprobs == results[0].prompt_logprobs == results[2].prompt_logprobs
    assert len(results[0].prompt_logprobs) == len(results[0].prompt_ids) - 1
    engine.close()
