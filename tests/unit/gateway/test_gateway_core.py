"""The gateway's edges over its generation core: the HTTP edge's drafts are validated exactly as the
gRPC API's requests (same GenerationRequest, or the same error), the HTTP numbers are read at protobuf's
precision, and the gRPC service is assembled from parts that serve each RPC once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.errors import InvalidRequestError
from loraserve.gateway.admin_service import AdapterAdminService
from loraserve.gateway.generation_request import Fields, grpc_fields, parse
from loraserve.gateway.grpc_calls import RPCS, add_loraserve
from loraserve.gateway.http.drafts import sampling_fields, wire_float
from loraserve.gateway.model_service import ModelService
from loraserve.gateway.service import GenerationService
from loraserve.gateway.validation import Limits
from loraserve.v1 import common_pb2, gateway_pb2

LIMITS = Limits(vocab_size=1024, max_context=512)
FLOATS = st.one_of(
    st.floats(allow_nan=False),
    st.sampled_from([0.0, -0.0, 1e-46, 0.7, 1.5, 2.0000001, 100.000001, 150.3, 3.4028236e38, 1e39]),
)
UINT32 = st.integers(0, 2**32 - 1)
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "temperature": FLOATS,
        "top_p": FLOATS,
        "top_k": UINT32,
        "min_p": FLOATS,
        "repetition_penalty": FLOATS,
        "presence_penalty": FLOATS,
        "frequency_penalty": FLOATS,
        "seed": st.integers(0, 2**64 - 1),
        "ignore_eos": st.booleans(),
        "logprobs": st.integers(0, 30),
        "prompt_logprobs": st.integers(0, 30),
    },
)


def _mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """`good` nine times in ten: a request fails at its first bad field, so the later ones need good earlier ones."""
    return st.tuples(st.sampled_from([False] * 9 + [True]), good, bad).map(lambda t: t[2] if t[0] else t[1])


REQUESTS = st.fixed_dictionaries(
    {
        "adapter": _mostly(st.sampled_from(["", "upper"]), st.sampled_from(["../etc", "a" * 80])),
        "prompt": _mostly(
            st.one_of(TEXT.filter(bool), st.lists(st.integers(0, 1023), min_size=1, max_size=4)),
            st.one_of(st.just(""), st.just([]), st.lists(st.integers(0, 1100), max_size=4)),
        ),
        "sampling": SAMPLING,
        "max_new_tokens": _mostly(st.integers(0, 400), UINT32),
        "stop": _mostly(st.lists(TEXT.filter(bool), max_size=3), st.lists(st.one_of(TEXT, st.just("x" * 300)))),
        "stop_token_ids": _mostly(st.lists(st.integers(0, 1023), max_size=3), st.lists(st.integers(0, 1100))),
        "include_stop": st.booleans(),
        "keep_special_tokens": st.booleans(),
        "cache_salt": _mostly(TEXT, st.just("s" * 200)),
        "prefill_group": _mostly(st.sampled_from(["", "g"]), st.just("g" * 200)),
        "client_request_id": _mostly(st.sampled_from(["", "c"]), st.just("c" * 200)),
    }
)
SAMPLING_OK = st.fixed_dictionaries(
    {"temperature": st.floats(0.01, 100), "top_p": st.floats(0.001, 1), "min_p": st.floats(0, 1)},
    optional={"presence_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.01, 10), "seed": UINT32},
)


def _grpc(fields: dict) -> gateway_pb2.GenerateRequest:
    prompt = fields["prompt"]
    return gateway_pb2.GenerateRequest(
        adapter=fields["adapter"],
        **({"text": prompt} if isinstance(prompt, str) else {"token_ids": gateway_pb2.TokenIds(ids=prompt)}),
        sampling=common_pb2.SamplingParameters(**fields["sampling"]),
        max_new_tokens=fields["max_new_tokens"],
        stop=fields["stop"],
        stop_token_ids=fields["stop_token_ids"],
        include_stop_str_in_output=fields["include_stop"],
        keep_special_tokens=fields["keep_special_tokens"],
        cache_salt=fields["cache_salt"],
        prefill_group=fields["prefill_group"],
        client_request_id=fields["client_request_id"],
    )


def _draft(fields: dict) -> Fields:
    """The HTTP edge's draft of the same request (`app.py` maps a body so)."""
    prompt = fields["prompt"]
    return {
        "adapter": fields["adapter"],
        "sampling": sampling_fields(dict(fields["sampling"]), fields["max_new_tokens"], fields["stop_token_ids"]),
        "stop": list(fields["stop"]),
        "include_stop": fields["include_stop"],
        "keep_special_tokens": fields["keep_special_tokens"],
        "cache_salt": fields["cache_salt"],
        "prompt_text" if isinstance(prompt, str) else "prompt_ids": prompt,
        "prefill_group": fields["prefill_group"],
        "client_request_id": fields["client_request_id"],
    }


def _outcome(validate):
    try:
        return validate()
    except InvalidRequestError as e:
        return ("refused", e.field, str(e))


@settings(max_examples=400, deadline=None)
@given(REQUESTS, st.one_of(SAMPLING, SAMPLING_OK))
def test_an_http_draft_validates_as_the_same_grpc_request(fields, sampling):
    fields = fields | {"sampling": sampling}
    expected = _outcome(lambda: parse(grpc_fields(_grpc(fields)), LIMITS))
    assert _outcome(lambda: parse(_draft(fields), LIMITS)) == expected


@settings(max_examples=2000, deadline=None)
@given(st.floats(allow_nan=False) | st.integers(-(2**80), 2**80))
def test_http_numbers_are_read_at_the_protos_float32_precision(value):
    assert wire_float(value) == common_pb2.SamplingParameters(temperature=value).temperature


def test_every_rpc_is_served_by_exactly_one_part():
    parts = (GenerationService, ModelService, AdapterAdminService)
    for name in RPCS:
        assert [p.__name__ for p in parts if callable(getattr(p, name, None))] != [], name
        assert sum(callable(getattr(p, name, None)) for p in parts) == 1, name
    with pytest.raises(ValueError, match="exactly one part"):
        add_loraserve(None, GenerationService(None), ModelService(None))
