"""The ZMQ wire format: typed round trips, raw buffers, and rejection of anything else."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from loraserve.params import SamplingParams
from loraserve.request_spec import RequestSpec
from loraserve.struct_errors import decode_problem
from loraserve.wire import (
    AdapterPayload,
    Assign,
    Cancel,
    MsgType,
    Prefetch,
    Tokens,
    WireError,
    WorkerReport,
    decode,
    encode,
)


def test_round_trip_keeps_every_field():
    spec = RequestSpec(
        "r1",
        [1, 2, 3],
        SamplingParams(max_new_tokens=5, stop_token_ids=(7,)),
        "tcp://127.0.0.1:1",
        1.5,
        adapter="upper",
        adapter_version=2,
        deadline=9.0,
    )
    assign = Assign(spec, queued_s=0.25, trace={"traceparent": "00-abc"})
    assert decode(encode(assign)) == assign
    tokens = Tokens("r1", [7], worker_id="w", finished=True, finish_reason="stop", timings={"queue_s": 0.1})
    assert decode(encode(tokens)) == tokens


def test_buffers_travel_as_their_own_frames():
    weights = bytes(range(256)) * 1000
    frames = encode(AdapterPayload("a", 3, "safetensors", config_json=b"{}", weights=weights))
    assert len(frames) == 4 and frames[3] is weights  # no copy on the way out
    decoded = decode(frames)
    assert bytes(decoded.weights) == weights and bytes(decoded.config_json) == b"{}"


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([b"\x63", msgpack.packb({})], "unknown message type"),
        ([bytes([MsgType.TOKENS]), b"\xc1"], "not msgpack"),
        ([bytes([MsgType.TOKENS]), msgpack.packb([1, 2])], "must be a map"),
        ([bytes([MsgType.TOKENS]), msgpack.packb({"token_ids": []})], "missing field 'request_id'"),
        ([bytes([MsgType.TOKENS]), msgpack.packb({"request_id": 5, "token_ids": []})], "request_id"),
        ([bytes([MsgType.TOKENS]), msgpack.packb({"request_id": "r", "token_ids": "x"})], "token_ids"),
        ([bytes([MsgType.ADAPTER]), msgpack.packb({"name": "a", "version": 1, "weights_format": "s"})], "frames"),
        ([bytes([MsgType.TOKENS])], "at least 2 frames"),
    ],
)
def test_malformed_messages_are_rejected(frames, message):
    with pytest.raises(WireError, match=message):
        decode(frames)


def test_prefetch_scores_travel_beside_their_adapters_and_are_checked():
    scored = Prefetch([("a", 1), ("b", 2)], [0.75, 0.0])
    assert decode(encode(scored)) == scored
    assert decode(encode(Prefetch([("a", 1)]))).scores == []  # unknown: the worker's UNKNOWN_SCORE
    frames = encode(scored)
    body = msgpack.unpackb(frames[1])
    for scores, message in [
        ([0.5], "differ in length"),
        ([0.5, 0.5, 0.5], "differ in length"),
        ([0.5, 1.5], r"scores\[1\]: Expected `float` <= 1.0"),
        ([-0.1, 0.5], r"scores\[0\]: Expected `float` >= 0.0"),
        ([0.5, float("nan")], r"scores\[1\]: Expected `float` >= 0.0"),
        ([0.5, "high"], "scores"),
        ([0.5] * 1025, "longer than 1024"),
    ]:
        with pytest.raises(WireError, match=message):
            decode([frames[0], msgpack.packb({**body, "scores": scores})])


def test_no_pickle_can_arrive():
    import pickle

    payload = pickle.dumps(WorkerReport)  # a pickled class instead of a msgpack map
    with pytest.raises(WireError):
        decode([bytes([MsgType.WORKER_REPORT]), payload])


def test_logprobs_travel_with_their_tokens_and_are_checked():
    from loraserve.wire import StepTokens, TokenLogprob

    entry = TokenLogprob(-0.5, [7, 3], [-0.5, -1.25])
    step = StepTokens("w", ["a", "b"], [[7], [3]], logprobs=[[entry], []], prompt_logprobs=[[entry, entry], []])
    decoded = decode(encode(step))
    assert decoded == step and [TokenLogprob(*e) for e in decoded.split()[0].logprobs] == [entry]
    assert decoded.split()[0].prompt_logprobs == [entry, entry] and decoded.split()[1].logprobs == []
    plain = StepTokens("w", ["a"], [[7]])
    assert [t.logprobs for t in decode(encode(plain)).split()] == [[]]  # nobody asked: nothing sent
    for bad, why in [
        (Tokens("a", [7, 8], logprobs=[entry]), "differ in length"),
        (Tokens("a", [7], logprobs=[(-0.5, [7, 3], [-0.5])]), "top_ids and top_logprobs"),
        (Tokens("a", [7], logprobs=[(float("-inf"), [], [])]), "finite"),
        (Tokens("a", [7], logprobs=[(-0.5, list(range(21)), [-1.0] * 21)]), "logprobs"),
        (StepTokens("w", ["a", "b"], [[7], [3]], logprobs=[[entry]]), "differ in length"),
        (StepTokens("w", ["a"], [[7, 8]], logprobs=[[entry]]), "differ in length"),
    ]:
        with pytest.raises(WireError, match=why):
            decode(encode(bad))


@pytest.mark.parametrize("bad", [b"\xa0\xa1", b"\xc3\x28", b"\xc0\x80", b"\xff\xfe"])
def test_a_string_that_is_not_utf8_is_a_wire_error(bad):
    """msgspec raises UnicodeDecodeError (up to 0.22) or DecodeError (0.23 on) for such a string; `decode`
    raises WireError and nothing else, in the same words under either, so no role's receive loop meets
    another exception (one such frame once stopped every role that read it)."""
    frames = [bytes(f) for f in encode(Cancel(request_ids=["r\u07fe"], reason="gone"))]
    frames[1] = frames[1].replace("\u07fe".encode(), bad)
    with pytest.raises(WireError, match=r"^Cancel: body holds a string that is not UTF-8"):
        decode(frames)


@pytest.mark.parametrize(
    "error",
    [
        UnicodeDecodeError("utf-8", b"\xc0\x80", 0, 1, "invalid start byte"),  # msgspec <= 0.22
        msgspec.DecodeError("Invalid UTF-8 encoded string"),  # msgspec >= 0.23
    ],
)
def test_a_string_that_is_not_utf8_reads_the_same_under_either_msgspec(error):
    """The installed msgspec raises one of these two; the words a client or a log reads are the same."""
    assert decode_problem(error, not_decodable="is not msgpack: ").startswith("holds a string that is not UTF-8")


def test_bytes_that_are_not_msgpack_say_so():
    assert decode_problem(msgspec.DecodeError("truncated"), not_decodable="is not msgpack: ") == (
        "is not msgpack: truncated"
    )
    with pytest.raises(WireError, match=r"^Cancel: body is not msgpack: "):
        decode([bytes(encode(Cancel(request_ids=["r"], reason="gone"))[0]), b"\xc1"])
