"""One request record: the scheduler's edge builds the spec once, the ASSIGN carries it, the worker's
engine holds it unchanged; the worker's sockets run on an I/O thread that decodes and sends for it."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from emulated import emulated_engine, fixed_profile

from loraserve.convert import sampling_from_pb
from loraserve.errors import InvalidRequestError
from loraserve.params import SamplingParams, encode_sampling
from loraserve.request_spec import RequestSpec, encode_spec
from loraserve.scheduler.submit import spec_from_submit
from loraserve.sockets import make_socket, send
from loraserve.v1 import common_pb2, scheduler_pb2
from loraserve.wire import Assign, Tokens, WorkerReport, decode, encode
from loraserve.worker.fetch_threads import Wakeup
from loraserve.worker.io_thread import GatewayGone, Unsendable, WorkerIO

SINK = "tcp://127.0.0.1:9"


def _submit(**changes) -> scheduler_pb2.SubmitRequest:
    sampling = common_pb2.SamplingParameters(temperature=0.5, top_p=0.9, seed=3, logprobs=2)
    fields = dict(
        request_id="r1",
        prompt_ids=[1, 5, 9],
        max_new_tokens=6,
        stop_token_ids=[2],
        sampling=sampling,
        reply_to=SINK,
        adapter="upper",
        adapter_version=1,
        adapter_rank=8,
        tenant="acme",
        ttft_slo_s=2.0,
        deadline_unix=time.time() + 60,
        arrival_unix=time.time(),
        output_ids=[4],
    )
    return scheduler_pb2.SubmitRequest(**{**fields, **changes})


def test_the_spec_travels_unchanged_from_the_scheduler_edge_to_the_engine_request(tmp_path):
    submit = _submit()
    spec = spec_from_submit(submit, time.time())
    assert (spec.adapter_key, spec.adapter_rank, spec.tenant, spec.ttft_slo_s) == (("upper", 1), 8, "acme", 2.0)
    assert (spec.prompt_ids, spec.output_ids, spec.sampling.stop_token_ids) == ([1, 5, 9], [4], (2,))
    received = decode([bytes(f) for f in encode(Assign(spec, queued_s=0.1))])
    assert received.spec == spec
    # the sampler's parameters are what the gateway-side conversion of the same proto gives, and the
    # engine's request reads the spec's own object
    params = received.spec.sampling
    assert params == sampling_from_pb(submit.sampling, submit.max_new_tokens, submit.stop_token_ids)
    engine = emulated_engine(fixed_profile(tmp_path / "profile.json"))
    request = engine.add_spec(received.spec)
    assert (
        request.spec is received.spec and request.spec.sampling is params and request.spec.adapter_key == ("upper", 1)
    )
    while engine.has_unfinished():
        engine.step()
    assert received.spec == spec, "running it changed nothing in the spec"
    with pytest.raises(AttributeError, match="immutable"):
        spec.prompt_ids = []


def test_the_scheduler_edge_refuses_bad_sampling_naming_the_field():
    with pytest.raises(InvalidRequestError, match="temperature"):
        spec_from_submit(_submit(sampling=common_pb2.SamplingParameters(temperature=-1e-4)), time.time())
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_the_gateways_sampling_params_reach_the_spec_as_sent():
    """The gateway sends its validated SamplingParams as msgpack; the spec holds an equal one, and the
    bytes replace the protobuf sampling fields."""
    params = SamplingParams(max_new_tokens=9, temperature=0.7, top_k=5, seed=11, stop_token_ids=(2, 3), logprobs=1)
    submit = _submit(sampling_params=encode_sampling(params), max_new_tokens=1)
    spec = spec_from_submit(submit, time.time())
    assert type(spec.sampling) is SamplingParams and spec.sampling == params
    assert (
        spec_from_submit(_submit(sampling_params=encode_sampling(SamplingParams())), 0.0).sampling == SamplingParams()
    )


@pytest.mark.parametrize(
    "data, field, why",
    [
        (msgspec.msgpack.encode({"max_new_tokens": 4, "temprature": 0.5}), "sampling_params", "unknown field"),
        (msgspec.msgpack.encode({"temperature": "hot"}), "sampling_params", "temperature"),
        (msgspec.msgpack.encode({"stop_token_ids": [-1]}), "sampling_params", "stop_token_ids"),
        (msgspec.msgpack.encode({"top_p": 0.0}), "top_p", "must be in"),
        (msgspec.msgpack.encode({"max_new_tokens": 1}), "output_ids", "max_new_tokens is 1"),  # one is generated
        (b"\x81\xa4seed", "sampling_params", "truncated"),
        (b"\xc1", "sampling_params", ""),
    ],
)
def test_the_scheduler_edge_refuses_bad_sampling_params_naming_what_is_wrong(data, field, why):
    with pytest.raises(InvalidRequestError) as info:
        spec_from_submit(_submit(sampling_params=data), time.time())
    assert info.value.field == field and why in str(info.value)


def _spec(**changes) -> RequestSpec:
    fields = dict(request_id="r1", prompt_ids=[1, 5, 9], sampling=SamplingParams(max_new_tokens=6), reply_to=SINK)
    return RequestSpec(**{**fields, "arrival": time.time(), **changes})


def test_the_gateways_spec_is_the_submits_request_as_sent():
    """The gateway builds the spec and sends it encoded; the scheduler's is equal, its other fields unread."""
    spec = _spec(adapter="upper", adapter_version=1, tenant="acme", ttft_slo_s=2.0, output_ids=[4], group="acme/g")
    submit = scheduler_pb2.SubmitRequest(request_id="r1", spec=encode_spec(spec), prompt_ids=[7], tenant="other")
    assert spec_from_submit(submit, 0.0) == spec


@pytest.mark.parametrize(
    "changes, field, why",
    [
        ({"ttft_slo_s": float("nan")}, "spec.ttft_slo_s", "Expected `float` >= 0.0"),
        ({"ttft_slo_s": 86401.0}, "spec.ttft_slo_s", "<= 86400.0"),
        ({"prompt_ids": [-1]}, "spec.prompt_ids", ">= 0"),
        ({"sampling": {"temprature": 1.0}}, "spec.sampling", "unknown field"),
        ({"reply_to": "nowhere"}, "reply_to", "tcp:// or ipc://"),
        ({"request_id": "r2"}, "request_id", "its spec"),
        ({"prompt_ids": []}, "prompt_ids", "must hold 1-"),
        ({"tenant": "a b"}, "tenant", "letters, digits"),
        ({"output_ids": [1] * 6}, "output_ids", "max_new_tokens is 6"),
    ],
)
def test_the_scheduler_edge_refuses_a_bad_spec_naming_the_field(changes, field, why):
    data = msgspec.msgpack.encode({**msgspec.to_builtins(_spec()), **changes})
    submit = scheduler_pb2.SubmitRequest(request_id="r1", spec=data)
    with pytest.raises(InvalidRequestError) as info:
        spec_from_submit(submit, time.time())
    assert info.value.field == field and why in str(info.value)
    with pytest.raises(InvalidRequestError, match="spec: MessagePack data is malformed"):
        spec_from_submit(scheduler_pb2.SubmitRequest(request_id="r1", spec=b"\xc1"), time.time())


def test_an_old_gateways_fields_are_checked_by_the_specs_annotations_naming_the_submits_field():
    for changes, field in (
        ({"ttft_slo_s": float("nan")}, "ttft_slo_s"),
        ({"deadline_unix": float("inf")}, "deadline_unix"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            spec_from_submit(_submit(**changes), time.time())
        assert info.value.field == field


def test_the_io_thread_decodes_sends_and_reports_what_failed():
    ctx = zmq.Context()
    scheduler = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    gateway = make_socket(ctx, zmq.PULL, bind="tcp://127.0.0.1:*")
    wakeup = Wakeup()
    io = WorkerIO(ctx, scheduler.getsockopt_string(zmq.LAST_ENDPOINT), "w1", wakeup)
    try:
        report = WorkerReport("w1", True, 8, 10, 10, 0, 0, [], [], [])
        io.to_scheduler(report)
        assert scheduler.poll(5000)
        identity, *frames = scheduler.recv_multipart()
        assert identity == b"w1" and decode(frames) == report
        spec = RequestSpec("r", [1] * 4096, SamplingParams(), gateway.getsockopt_string(zmq.LAST_ENDPOINT), 1.0)
        send(scheduler, Assign(spec), to=b"w1")
        assert io.inbox.get(timeout=5) == Assign(spec)  # decoded on the I/O thread
        io.to_gateway(spec.reply_to, Tokens("r", [7]))
        assert gateway.poll(5000) and decode(gateway.recv_multipart()) == Tokens("r", [7])
        io.to_gateway("not-an-endpoint", Tokens("r", [8]), ["r"])
        event = io.events.get(timeout=5)
        assert isinstance(event, Unsendable) and (event.address, event.request_ids) == ("not-an-endpoint", ["r"])
        gateway.close(linger=0)
        assert io.events.get(timeout=5) == GatewayGone(spec.reply_to)
    finally:
        io.close(linger_ms=0)
        wakeup.close()
        scheduler.close(linger=0)
        if not gateway.closed:
            gateway.close(linger=0)
        ctx.term()


# Two bytes that are not UTF-8: a lone continuation pair, a cut sequence, an overlong NUL, bytes never used.
NOT_UTF8 = [b"\xa0\xa1", b"\xc3\x28", b"\xc0\x80", b"\xff\xfe"]


def _with_bad_string(encoded: bytes, bad: bytes) -> bytes:
    """`encoded` with its one string "\u07fe" (two bytes of UTF-8) turned into `bad`."""
    mark = "\u07fe".encode()
    assert encoded.count(mark) == 1
    return encoded.replace(mark, bad)


@pytest.mark.parametrize("bad", NOT_UTF8)
def test_a_string_that_is_not_utf8_is_refused_naming_the_field(bad):
    """msgspec raises UnicodeDecodeError (up to 0.22) or DecodeError (0.23 on) for such a string: a Submit's
    spec or sampling parameters holding one are refused INVALID_ARGUMENT, never an internal error."""
    spec = RequestSpec("r\u07fe", [1, 2], SamplingParams(max_new_tokens=4), SINK, 1.0)
    with pytest.raises(InvalidRequestError, match=r"^spec: holds a string that is not UTF-8"):
        spec_from_submit(
            scheduler_pb2.SubmitRequest(request_id="r", spec=_with_bad_string(encode_spec(spec), bad)), 2.0
        )
    sampling = _with_bad_string(msgspec.msgpack.encode({"max_new_tokens": 4, "\u07fe": 1}), bad)
    with pytest.raises(InvalidRequestError, match=r"^sampling_params: holds a string that is not UTF-8"):
        spec_from_submit(_submit(sampling_params=sampling), 2.0)
