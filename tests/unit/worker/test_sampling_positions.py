"""Seeded sampling keyed by (seed, position): a request continued from a prefix of its own output
draws exactly the tokens it would have drawn (what failover and preemption need), whatever else
shares the batch."""

from __future__ import annotations

import pytest

from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.sampling import SamplingParams, draw_seed

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_adapters):
    engine = Engine(tiny_model, EngineConfig(device="cpu", dtype="float32", pool_pages=256, rows_per_page=8))
    engine.register_adapter("a", tiny_adapters["r16-all-rslora"])
    yield engine
    engine.close()


def _sampling(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.3, top_p=0.95, seed=42, ignore_eos=True)


@pytest.mark.parametrize("adapter", [None, "a"])
@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_continuation_from_a_prefix_draws_the_same_tokens(engine, adapter, cut):
    prompt = [1, 17, 33, 9]
    (whole,) = engine.generate([GenerateRequest(prompt_ids=prompt, adapter=adapter, sampling=_sampling(NEW_TOKENS))])
    assert len(set(whole.token_ids)) > 3, "sampling at this temperature should vary"
    resumed = GenerateRequest(
        prompt_ids=prompt + whole.token_ids[:cut], adapter=adapter, sampling=_sampling(NEW_TOKENS - cut)
    )
    others = [
        GenerateRequest(prompt_ids=[2, 3], sampling=SamplingParams(max_new_tokens=6, temperature=0.8, seed=i))
        for i in range(3)
    ]
    result = engine.generate([others[0], resumed, *others[1:]])[1]
    assert result.token_ids == whole.token_ids[cut:]


def test_draw_seeds_differ_by_position_and_seed_and_fit_a_generator():
    seeds = {draw_seed(seed, position) for seed in range(50) for position in range(200)}
    assert len(seeds) == 50 * 200
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("cut", [1, 7])
def test_a_continuation_given_its_output_ids_matches_even_with_output_penalties(engine, cut):
    """Failover hands a worker the tokens already streamed as `output_ids`: they count for the
    presence and frequency penalties and for max_new_tokens exactly as if generated there."""
    sampling = SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0.9, seed=7, presence_penalty=1.5, frequency_penalty=0.8, ignore_eos=True
    )
    prompt = [1, 17, 33, 9]
    (whole,) = engine.generate([GenerateRequest(prompt_ids=prompt, adapter="a", sampling=sampling)])
    request = engine.add_request(prompt, sampling, "a", output_ids=whole.token_ids[:cut])
    while engine.has_unfinished():
        engine.step()
    assert request.output_ids == whole.token_ids
