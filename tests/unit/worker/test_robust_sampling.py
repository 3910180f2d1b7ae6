"""Sampling values that pass as numbers but break the arithmetic are refused; the sampler never raises.

A float32 subnormal temperature (1.4e-45 and anything up to ~1e-38) used to pass validation and
then overflow logits / temperature to infinity, so torch.multinomial raised and the worker died.
Every temperature in (0, MIN_TEMPERATURE) is now greedy (stored as 0, what clients mean by 1e-4 or
1e-6), on every edge; negative, non-finite and over-100 ones are refused.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loraserve.errors import InvalidRequestError
from loraserve.params import MIN_REPETITION_PENALTY, MIN_TEMPERATURE
from loraserve.worker.sampling import SamplingParams, sample


@pytest.mark.parametrize("temperature", [-1e-4, -1.4e-45, -1.0, float("nan"), float("inf"), float("-inf"), 101.0])
def test_meaningless_temperatures_are_refused(temperature: float):
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=temperature)


TINY_TEMPERATURES = [1e-4, 1e-6, 1e-9, 1e-38, 1.4e-45, MIN_TEMPERATURE / 2]


def _built(edge: str, temperature: float) -> SamplingParams:
    """The SamplingParams an edge builds from a request asking for `temperature`."""
    from loraserve.convert import sampling_from_pb
    from loraserve.gateway.generation_request import grpc_fields, parse
    from loraserve.gateway.http.drafts import sampling_fields
    from loraserve.gateway.validation import Limits
    from loraserve.params import decode_sampling
    from loraserve.v1 import common_pb2, gateway_pb2

    if edge == "engine":  # the offline engine's, and everything else's, keyword construction
        return SamplingParams(max_new_tokens=4, temperature=temperature)
    if edge == "http":  # the OpenAI-compatible API's (the value rounded to float32, as the proto holds it)
        draft = {"prompt_text": "hi", "sampling": sampling_fields({"temperature": temperature}, 4)}
        return parse(draft, Limits(vocab_size=100, max_context=512)).sampling
    if edge == "grpc":  # the gateway's
        sampling = common_pb2.SamplingParameters(temperature=temperature)
        request = gateway_pb2.GenerateRequest(text="hi", sampling=sampling, max_new_tokens=4)
        return parse(grpc_fields(request), Limits(vocab_size=100, max_context=512)).sampling
    if edge == "submit":  # a Submit from a gateway of release 0.1, its sampling in protobuf fields
        return sampling_from_pb(common_pb2.SamplingParameters(temperature=temperature), 4, [])
    return decode_sampling(msgspec.msgpack.encode({"max_new_tokens": 4, "temperature": temperature}))  # scheduler


@pytest.mark.parametrize("edge", ["engine", "http", "grpc", "submit", "scheduler"])
@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_tiny_temperatures_are_greedy_on_every_edge(edge: str, temperature: float):
    """Clients (lm-eval, SDK examples) send 1e-4 or 1e-6 meaning greedy: it is greedy, not refused."""
    params = _built(edge, temperature)
    assert params.temperature == 0.0 and params.greedy
    assert params == _built(edge, 0.0)


@pytest.mark.parametrize("edge", ["engine", "http", "grpc", "submit", "scheduler"])
def test_the_smallest_temperature_and_negative_ones_are_kept_as_they_were(edge: str):
    assert _built(edge, MIN_TEMPERATURE).temperature == pytest.approx(MIN_TEMPERATURE)
    with pytest.raises(InvalidRequestError, match="temperature") as caught:
        _built(edge, -1e-4)
    assert caught.value.status == "INVALID_ARGUMENT"


@pytest.mark.parametrize("penalty", [1.4e-45, 1e-30, MIN_REPETITION_PENALTY / 2, 0.0, 11.0])
def test_meaningless_repetition_penalties_are_refused(penalty: float):
    with pytest.raises(InvalidRequestError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=penalty)


@given(
    temperature=st.one_of(st.just(0.0), st.floats(MIN_TEMPERATURE, 100.0)),
    penalty=st.floats(MIN_REPETITION_PENALTY, 10.0),
    scale=st.floats(1e-3, 1e4),
)
def test_every_accepted_value_samples_a_token(temperature: float, penalty: float, scale: float):
    """Any accepted setting on logits of any realistic size gives a token, never an error."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * scale
    params = [SamplingParams(temperature=temperature, repetition_penalty=penalty, top_p=0.9, seed=1)] * 2
    history = [([1, 2, 3], [4]), ([5], [])]
    tokens = sample(logits, params, [1, 1], history)
    assert all(isinstance(t, int) and 0 <= t < 50 for t in tokens)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_draws_only_tokens_likely_enough(min_p: float):
    """Every draw is among the tokens at least min_p times as likely as the most likely one (after
    temperature), and at min_p 1 that is the most likely one alone."""
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(3)) * 2
    probs = torch.softmax(logits[0] / 0.7, -1)
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    drawn = {
        sample(logits, [SamplingParams(temperature=0.7, min_p=min_p, seed=s)], [s], [([1], [])])[0] for s in range(200)
    }
    assert drawn <= allowed and (min_p < 1.0 or drawn == {int(probs.argmax())})
    unfiltered = {sample(logits, [SamplingParams(temperature=0.7, seed=s)], [s], [([1], [])])[0] for s in range(200)}
    assert not unfiltered <= allowed or min_p == 0.05  # the filter is what keeps the draws in


@pytest.mark.parametrize("min_p", [-0.1, 1.5, float("nan")])
def test_min_p_outside_0_1_is_refused(min_p: float):
    with pytest.raises(InvalidRequestError, match="min_p"):
        SamplingParams(min_p=min_p)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_row_gets_no_token_and_the_others_are_unchanged(poison: float):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=0.7, seed=4), SamplingParams()]
    history = [([1], []), ([2], []), ([3], [])]

    def run(x: torch.Tensor) -> list:
        return sample(x, params, [3, 4, 0], history)

    expected = run(logits)
    poisoned = logits.clone()
    poisoned[1, 7] = poison
    tokens = run(poisoned)
    assert tokens[1] is None
    assert tokens[0] == expected[0] and tokens[2] == expected[2]


def test_a_subnormal_temperature_from_the_wire_is_greedy():
    """The gateway's path: the proto's float32 field holds 1.4e-45 exactly; it must not reach the sampler as a
    divisor: it is greedy."""
    from loraserve.convert import sampling_from_pb
    from loraserve.v1 import common_pb2

    pb = common_pb2.SamplingParameters(temperature=1.4e-45)
    assert 0.0 < pb.temperature < 1e-38  # the value really reaches the server as a subnormal
    assert sampling_from_pb(pb, max_new_tokens=4, stop_token_ids=[]).temperature == 0.0


def _unchecked(params: SamplingParams, **values) -> SamplingParams:
    """`params` with fields set past validation, as a bug or a future field could let through."""
    for name, value in values.items():
        msgspec.structs.force_setattr(params, name, value)
    return params


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": 1.4e-45},
        {"temperature": 1.4e-45, "top_k": 5, "top_p": 0.5},
        {"temperature": 0.7, "repetition_penalty": 1e-45},
    ],
    ids=["subnormal-temperature", "subnormal-temperature-top-k-top-p", "subnormal-repetition-penalty"],
)
def test_the_engine_survives_sampling_values_past_validation(tiny_model, bad: dict):
    """The sampler is the last guard: a request whose numbers overflow ends alone with an error;
    the worker does not die and the other requests' tokens are those of a run without it."""
    from loraserve.worker.config import EngineConfig
    from loraserve.worker.engine import Engine, FinishReason, GenerateRequest

    engine = Engine(tiny_model, EngineConfig(device="cpu", dtype="float32", pool_pages=128, rows_per_page=8))
    good = [
        GenerateRequest(prompt_ids=[1, 5, 9], sampling=SamplingParams(max_new_tokens=4, ignore_eos=True)),
        GenerateRequest(
            prompt_ids=[1, 7], sampling=SamplingParams(max_new_tokens=4, temperature=0.8, seed=5, ignore_eos=True)
        ),
    ]
    alone = engine.generate(good)
    poisoned = GenerateRequest(
        prompt_ids=[1, 2, 3], sampling=_unchecked(SamplingParams(max_new_tokens=4, seed=6, ignore_eos=True), **bad)
    )
    mixed = engine.generate([good[0], poisoned, good[1]])
    assert mixed[1].finish_reason == FinishReason.ERROR and "non-finite" in (mixed[1].error or "")
    assert [r.token_ids for r in (mixed[0], mixed[2])] == [r.token_ids for r in alone]
    assert all(r.error is None for r in (mixed[0], mixed[2]))
