"""Log-probabilities against transformers + peft: the log-softmax of the reference's logits at every
position of prompt + output, for many adapters in one batch, through chunked prefill and preemption.

Tolerance: log-probabilities within 1e-4 (float32; the engine's logits agree with PEFT's within
1e-4, see test_engine_parity.py, and log-softmax does not amplify a common shift). The top
alternatives are the reference's, in order, wherever the reference's values are further apart
than that tolerance (closer ones may be ordered either way).
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_sequence_logits

from loraserve.errors import InvalidRequestError
from loraserve.params import MAX_LOGPROBS
from loraserve.wire import TokenLogprob
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine, GenerateRequest, GenerateResult
from loraserve.worker.logprobs import ROWS_PER_SLICE, logprobs_from_logits, score_rows
from loraserve.worker.sampling import SamplingParams

TOL = 1e-4
PROMPTS = [
    [1, 5, 9, 33, 7, 41, 2, 300, 18],
    [1, 44, 3, 99],
    [1, 8, 8, 8, 8, 8, 8, 200, 17, 301, 5, 77, 12],
    [1, 17],
    [1, 600, 2, 902, 14, 5, 5],
]


def _engine(model, adapters, **overrides) -> Engine:
    engine = Engine(model, EngineConfig(device="cpu", pool_pages=overrides.pop("pool_pages", 96), **overrides))
    for name, path in adapters.items():
        engine.register_adapter(name, path)
    return engine


def _check(entry: TokenLogprob, token: int, reference: torch.Tensor, top: int) -> None:
    """One reported token against the reference's log-softmax row at its position."""
    assert entry.logprob == pytest.approx(reference[token].item(), abs=TOL)
    assert len(entry.top_ids) == len(entry.top_logprobs) == top
    expected = torch.topk(reference, top + 1)
    assert entry.top_logprobs == pytest.approx(expected.values[:top].tolist(), abs=TOL)
    for rank, token_id in enumerate(entry.top_ids):
        gap_before = rank == 0 or expected.values[rank - 1] - expected.values[rank] > TOL
        gap_after = expected.values[rank] - expected.values[rank + 1] > TOL
        if gap_before and gap_after:  # a clear rank: the reference's token
            assert token_id == expected.indices[rank].item(), rank
    assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)


def _check_result(
    model, adapter_path, prompt: list[int], result: GenerateResult, top: int, prompt_top: int | None
) -> None:
    """`prompt_top` None: the prompt was not scored."""
    reference = torch.log_softmax(hf_sequence_logits(model, adapter_path, prompt + result.token_ids), -1)
    if prompt_top is not None:
        assert len(result.prompt_logprobs) == len(prompt) - 1
    for i, entry in enumerate(result.prompt_logprobs):  # row i predicts prompt token i + 1
        _check(entry, prompt[i + 1], reference[i], prompt_top)
    assert len(result.logprobs) == len(result.token_ids)
    for j, (entry, token) in enumerate(zip(result.logprobs, result.token_ids, strict=True)):
        _check(entry, token, reference[len(prompt) - 1 + j], top)


def _requests(adapters, sampling: SamplingParams) -> list[GenerateRequest]:
    names = [None, *adapters, None][: len(PROMPTS)]
    return [GenerateRequest(prompt_ids=p, adapter=a, sampling=sampling) for p, a in zip(PROMPTS, names, strict=True)]


SAMPLING = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=3)


@pytest.mark.parametrize("variant", [{}, {"max_batched_tokens": 4}], ids=["one-step-prefill", "chunked-prefill"])
def test_logprobs_match_peft(tiny_model, tiny_adapters, variant):
    """Greedy, top 5 for the output and top 3 for the prompt, every adapter in one batch."""
    engine = _engine(tiny_model, tiny_adapters, **variant)
    requests = _requests(tiny_adapters, SAMPLING)
    results = engine.generate(requests)
    for request, result in zip(requests, results, strict=True):
        _check_result(tiny_model, tiny_adapters.get(request.adapter), request.prompt_ids, result, 5, 3)


def test_logprobs_survive_preemption(tiny_model, tiny_adapters):
    """A preempted request recomputes its KV: what it reports is still each position's value, once."""
    small = {name: tiny_adapters[name] for name in ("r4-qv", "r8-kod-layer1")}
    engine = _engine(tiny_model, small, pool_pages=40, rows_per_page=8)
    names = [None, "r4-qv", "r8-kod-layer1", "r4-qv", None]
    requests = [
        GenerateRequest(prompt_ids=p, adapter=a, sampling=SAMPLING) for p, a in zip(PROMPTS, names, strict=True)
    ]
    results = engine.generate(requests * 2)
    assert sum(r.num_preemptions for r in results) > 0, "the pool was meant to force preemption"
    for request, result in zip(requests * 2, results, strict=True):
        _check_result(tiny_model, tiny_adapters.get(request.adapter), request.prompt_ids, result, 5, 3)


def test_sampled_tokens_get_their_own_logprob(tiny_model, tiny_adapters):
    """With temperature, top-k and penalties the reported values are still the model's distribution's,
    for the token that was drawn, which is not always the most likely one."""
    engine = _engine(tiny_model, tiny_adapters)
    sampling = SamplingParams(
        max_new_tokens=10, ignore_eos=True, temperature=1.5, top_k=40, repetition_penalty=1.3, seed=7, logprobs=1
    )
    name = next(iter(tiny_adapters))
    (result,) = engine.generate([GenerateRequest(prompt_ids=PROMPTS[0], adapter=name, sampling=sampling)])
    assert result.prompt_logprobs == []  # not asked for
    _check_result(tiny_model, tiny_adapters[name], PROMPTS[0], result, 1, None)
    assert any(e.top_ids[0] != token for e, token in zip(result.logprobs, result.token_ids, strict=True))


def test_asking_for_nothing_reports_nothing(tiny_model):
    engine = _engine(tiny_model, {})
    (result,) = engine.generate([GenerateRequest(prompt_ids=PROMPTS[0], sampling=SamplingParams(max_new_tokens=3))])
    assert result.logprobs == [] and result.prompt_logprobs == []


def test_a_continued_request_does_not_report_its_prompt_again(tiny_model):
    """A failover continues a request from the tokens already streamed; its prompt's log-probabilities
    went out with the first token, so the continuation sends none, and scores only new tokens."""
    engine = _engine(tiny_model, {})
    sampling = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    (whole,) = engine.generate([GenerateRequest(prompt_ids=PROMPTS[2], sampling=sampling)])
    request = engine.add_request(PROMPTS[2], sampling, output_ids=whole.token_ids[:2])
    outputs = []
    while not request.finished:
        outputs += [o for o in engine.step() if o.request_id == request.request_id]
    assert all(o.prompt_logprobs == [] for o in outputs)
    assert request.output_ids == whole.token_ids
    continued = [e for o in outputs for e in o.logprobs]
    assert [e.logprob for e in continued] == pytest.approx([e.logprob for e in whole.logprobs[2:]], abs=TOL)
    assert [e.top_ids for e in continued] == [e.top_ids for e in whole.logprobs[2:]]


def test_prompt_rows_are_scored_in_bounded_slices():
    """A prompt longer than a slice gives the values one full-width pass would."""
    torch.manual_seed(0)
    hidden = torch.randn(ROWS_PER_SLICE * 2 + 3, 8)
    weight = torch.randn(50, 8)
    targets = torch.randint(0, 50, (hidden.shape[0],)).tolist()
    seen: list[int] = []

    def logits_of(rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.shape[0])
        return rows @ weight.T

    sliced = score_rows(logits_of, hidden, targets, 4)
    whole = logprobs_from_logits(hidden @ weight.T, targets, [4] * len(targets))
    assert max(seen) == ROWS_PER_SLICE and sum(seen) == hidden.shape[0]
    assert [e.logprob for e in sliced] == pytest.approx([e.logprob for e in whole], abs=1e-6)
    assert [e.top_ids for e in sliced] == [e.top_ids for e in whole]


def test_values_are_finite_where_logits_rule_tokens_out():
    """-inf logits (a token ruled out) and NaN give the lowest float32, which the wire carries."""
    logits = torch.tensor([[0.0, -float("inf"), 1.0], [float("nan"), 0.0, 0.0]])
    entries = logprobs_from_logits(logits, [1, 0], [3, 1])
    assert entries[0].logprob == torch.finfo(torch.float32).min
    assert entries[0].top_ids[:2] == [2, 0] and entries[0].top_logprobs[2] == torch.finfo(torch.float32).min
    assert all(abs(v) < float("inf") for e in entries for v in [e.logprob, *e.top_logprobs])


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 2.0])
@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_out_of_range_counts_are_refused(name, value):
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**{name: value})
