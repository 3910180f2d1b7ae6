"""Gateway pieces that need no process: validation, stop sequences, incremental detokenization."""

from __future__ import annotations

import pytest

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import InvalidRequestError
from loraserve.gateway.generation_request import GenerationRequest, grpc_fields, parse
from loraserve.gateway.stops import StopFilter
from loraserve.gateway.validation import Limits, check_context
from loraserve.tokenizer import IncrementalDetokenizer, Tokenizer
from loraserve.v1 import common_pb2, gateway_pb2

LIMITS = Limits(vocab_size=1024, max_context=512)


def validate_generate(request: gateway_pb2.GenerateRequest, limits: Limits) -> GenerationRequest:
    """What the gateway makes of a gRPC request: its fields, parsed after admission."""
    return parse(grpc_fields(request), limits)


def _request(**fields) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(**{**TEXT, **fields})


TEXT = {"text": "the old fox"}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"text": ""}, "prompt"),
        ({"token_ids": gateway_pb2.TokenIds(ids=[])}, "prompt"),
        ({"token_ids": gateway_pb2.TokenIds(ids=[5, 5000])}, "prompt.token_ids"),
        ({**TEXT, "adapter": "../etc"}, "adapter"),
        ({**TEXT, "sampling": common_pb2.SamplingParameters(temperature=-1)}, "sampling.temperature"),
        ({**TEXT, "sampling": common_pb2.SamplingParameters(top_p=1.5)}, "sampling.top_p"),
        ({**TEXT, "sampling": common_pb2.SamplingParameters(repetition_penalty=11)}, "sampling.repetition_penalty"),
        ({**TEXT, "sampling": common_pb2.SamplingParameters(presence_penalty=3)}, "sampling.presence_penalty"),
        ({**TEXT, "stop": ["x"] * 9}, "stop"),
        ({**TEXT, "stop": [""]}, "stop"),
        ({**TEXT, "stop_token_ids": [99999]}, "stop_token_ids"),
        ({**TEXT, "max_new_tokens": 512}, "max_new_tokens"),
        ({**TEXT, "client_request_id": "x" * 200}, "client_request_id"),
    ],
)
def test_invalid_fields_are_named(fields, field):
    with pytest.raises(InvalidRequestError) as info:
        validate_generate(gateway_pb2.GenerateRequest(**fields), LIMITS)
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")


def test_defaults_and_context_check():
    valid = validate_generate(_request(), LIMITS)
    assert valid.sampling.max_new_tokens == LIMITS.default_max_new_tokens and valid.sampling.greedy
    with pytest.raises(InvalidRequestError, match="lower max_new_tokens to at most 12"):
        check_context(list(range(500)), validate_generate(_request(max_new_tokens=100), LIMITS).sampling, LIMITS)


def test_stop_filter_holds_back_possible_stops():
    f = StopFilter(["END", "xyz"])
    assert f.feed("hello E") == ("hello ", False)  # "E" might start "END"
    assert f.feed("N") == ("", False)
    assert f.feed("D and more") == ("", True)  # the stop and what follows never appear
    g = StopFilter(["END"])
    assert g.feed("an E") == ("an ", False)
    assert g.feed("xit") == ("Exit", False)
    assert g.feed(" E") == (" ", False)
    assert g.flush() == "E"


def test_stop_filter_can_keep_the_stop_sequence():
    f = StopFilter(["END", "ENDS"], include=True)
    assert f.feed("a E") == ("a ", False)
    assert f.feed("NDS b") == ("END", True)  # the first stop to start, the shorter of two there
    assert f.flush() == ""
    assert StopFilter(["xy"], include=True).feed("1xy2xy") == ("1xy", True)


def test_special_tokens_text_is_kept_only_when_asked():
    tokenizer = Tokenizer.from_model_dir(DEMO_MODEL_DIR)
    ids = [*tokenizer.encode("the fox", add_special_tokens=False), *tokenizer.eos_token_ids]
    for skip, expected in ((True, "the fox"), (False, "the fox</s>")):
        detok = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=skip)
        assert "".join(detok.push(i) for i in ids) + detok.flush() == expected


def test_incremental_detokenizer_handles_multibyte_characters():
    tokenizer = Tokenizer.from_model_dir(DEMO_MODEL_DIR)
    text = "the café ünïcödé 日本 fox"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1])
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize(
    ("status", "cls", "kept"),
    [
        ("NOT_FOUND", "NotFoundError", "NOT_FOUND"),
        ("UNAVAILABLE", "UnavailableError", "UNAVAILABLE"),
        ("DATA_LOSS", "DataLossError", "DATA_LOSS"),
        ("CANCELLED", "LoraserveError", "CANCELLED"),
        ("UNKNOWN", "LoraserveError", "INTERNAL"),
        ("NOT_A_STATUS", "LoraserveError", "INTERNAL"),
    ],
)
def test_a_status_from_another_process_becomes_the_error_that_carries_it(status, cls, kept):
    from loraserve.errors import error_for_status

    error = error_for_status(status, "why")
    assert type(error).__name__ == cls and error.status == kept and str(error) == "why"
