"""Property-based fuzzing of every public RPC against a running stack.

Hypothesis builds random, validly typed messages for each request of `loraserve.v1.LoraServe`
straight from the proto descriptors (every scalar, enum, repeated, nested and oneof field), and
random raw bytes (often not protobuf at all) sent with generic gRPC calls. One stack on the
embedded demo model serves the whole module. Properties: no call ends INTERNAL or UNKNOWN, every
call ends within its deadline, and the gateway still answers health SERVING afterwards.

The default budget keeps the module well under a minute. For a longer hunt:
    LORASERVE_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest -q tests/fuzz/test_fuzz_rpc.py
"""

from __future__ import annotations

import os
import time

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from scheduler_proc import scheduler_with_worker
from stack import LocalStack
from store_proc import StoreProcess

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.params import SamplingParams
from loraserve.v1 import adapter_store_pb2, gateway_pb2, scheduler_pb2

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("LORASERVE_FUZZ_EXAMPLES", "25"))
DEADLINE_S = 10.0
SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["LoraServe"]
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

_INTS = {
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: st.integers(0, 2**64 - 1),
}
_SMALL_INTS = st.integers(-3, 1100)  # around the demo model's vocabulary and context, where checks bite
_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["upper", "rot13", "reverse", "a" * 300, "../x", "/etc", "x\x00y", ".", "team/upper"]),
)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    t = field.type
    if t in _INTS:
        return st.one_of(_SMALL_INTS.filter(lambda v, t=t: v >= 0 or t not in _UNSIGNED), _INTS[t])
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.floats(-3, 3, width=32))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return _TEXT
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FieldDescriptor.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 50))
    raise AssertionError(f"unhandled field type {t} of {field.full_name}")


_UNSIGNED = {
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_FIXED32,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_FIXED64,
}


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy:
    """Random messages of `descriptor`'s type: each field set or not, oneofs resolved by the last set."""
    fields = {}
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth >= 3:
                continue
            value = messages(field.message_type, depth + 1)
        else:
            value = _scalar(field)
        if field.is_repeated:
            value = st.lists(value, max_size=6)
        fields[field.name] = st.one_of(st.none(), value)
    cls = _message_class(descriptor)

    def build(values: dict) -> object:
        message = cls()
        for name, value in values.items():
            if value is None:
                continue
            field = descriptor.fields_by_name[name]
            if _is_map(field):  # a map<K, V>: its entries are messages with a key and a value
                getattr(message, name).update({e.key: e.value for e in value})
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                target = getattr(message, name)
                if field.is_repeated:
                    for item in value:
                        target.add().CopyFrom(item)
                else:
                    target.CopyFrom(value)
            elif field.is_repeated:
                getattr(message, name).extend(value)
            else:
                setattr(message, name, value)
        return message

    return st.fixed_dictionaries(fields).map(build)


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _message_class(descriptor: Descriptor):
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


@pytest.fixture(scope="module")
def stack():
    stack = LocalStack(DEMO_MODEL_DIR, 1, max_batch_size=8).start()
    yield stack
    stack.stop()


def _call(channel: grpc.Channel, method, request: bytes, service=SERVICE, first_only: bool = False) -> None:
    """One raw call; asserts the properties on its outcome. `first_only`: a server stream that only ends when
    cancelled (a watch) is read to its first message, then cancelled."""
    path = f"/{service.full_name}/{method.name}"
    started = time.monotonic()
    try:
        if method.client_streaming and method.server_streaming:
            for _ in channel.stream_stream(path)(iter([request]), timeout=DEADLINE_S):
                pass
        elif method.client_streaming:
            channel.stream_unary(path)(iter([request]), timeout=DEADLINE_S)
        elif method.server_streaming:
            stream = channel.unary_stream(path)(request, timeout=DEADLINE_S)
            for _ in stream:
                if first_only:
                    stream.cancel()
                    break
        else:
            channel.unary_unary(path)(request, timeout=DEADLINE_S)
    except grpc.RpcError as e:
        assert e.code() not in FORBIDDEN, f"{method.name}({request[:200]!r}) -> {e.code().name}: {e.details()}"
    assert time.monotonic() - started < DEADLINE_S + 2, f"{method.name} outlived its deadline"


@pytest.mark.parametrize("method", list(SERVICE.methods), ids=lambda m: m.name)
def test_random_valid_typed_requests_never_fail_internally(stack, method):
    @FUZZ
    @given(messages(method.input_type))
    def check(message):
        _call(stack.channel, method, message.SerializeToString())

    check()


_RAW = st.one_of(
    st.binary(max_size=80),
    st.builds(lambda tag, body: bytes([tag, len(body)]) + body, st.integers(0, 255), st.binary(max_size=60)),
    st.sampled_from([b"\x0a\x02\xff\xfe", b"\x12\x03\xc3\x28\x41", b"\x08", b"\xff" * 10]),  # invalid UTF-8 ...
)


@pytest.mark.parametrize("method", list(SERVICE.methods), ids=lambda m: m.name)
def test_raw_bytes_never_fail_internally(stack, method):
    @FUZZ
    @given(_RAW)
    def check(raw):
        _call(stack.channel, method, raw)

    check()


def test_the_gateway_still_serves_afterwards(stack):
    health = health_pb2_grpc.HealthStub(stack.channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE.full_name), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    request = gateway_pb2.GenerateRequest(text="the quiet king", max_new_tokens=4)  # the fuzz may delete adapters
    assert stack.api.Generate(request, timeout=30).usage.completion_tokens > 0


SCHEDULER = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"]


# A valid request (its prompt of 3 tokens) whose KV reserves all of the fake worker's pages (report():
# 10,000 of 16 tokens) until it is reported finished: a worker that never finished what it was assigned
# would leave no room for the requests of the tests after it, whatever they are.
WHOLE_POOL = 10_000 * 16 - 3


@pytest.fixture(scope="module")
def scheduler():
    with scheduler_with_worker(finishes=True) as running:  # a worker that serves each ASSIGN at once
        yield running


def _valid_submit(request_id: str, max_new_tokens: int = 4, **fields) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id=request_id,
        prompt_ids=[1, 2, 3],
        max_new_tokens=max_new_tokens,
        reply_to="tcp://127.0.0.1:9",
        arrival_unix=time.time(),
        **fields,
    )


# msgpack maps whose string is not UTF-8 (msgspec < 0.23 raises UnicodeDecodeError for it, not a DecodeError): a
# spec of 4 fields whose first key is cut short, and sampling params whose key is an encoded surrogate
NOT_UTF8_SPEC = b"\x84\xa4\xea7\xa1\xd4\xb4"
NOT_UTF8_SAMPLING = b"\x81\xa3\xed\xa0\x80\x01"


@st.composite
def near_valid_submits(draw) -> scheduler_pb2.SubmitRequest:
    """A Submit the scheduler would accept, with one field (or a sampling field) taken from a random one."""
    submit = _valid_submit(f"fuzz-{draw(st.integers(0, 2**62))}")
    donor = draw(messages(scheduler_pb2.SubmitRequest.DESCRIPTOR))
    target, source = (submit, donor)
    if draw(st.booleans()):
        target, source = submit.sampling, donor.sampling
    name = draw(st.sampled_from([f.name for f in target.DESCRIPTOR.fields]))
    target.ClearField(name)
    value = getattr(source, name)
    if _is_map(target.DESCRIPTOR.fields_by_name[name]):
        getattr(target, name).update(value)
    elif target.DESCRIPTOR.fields_by_name[name].is_repeated:
        getattr(target, name).extend(value)
    elif hasattr(value, "CopyFrom"):
        getattr(target, name).CopyFrom(value)
    else:
        setattr(target, name, value)
    return submit


def test_fuzzed_submits_never_fail_internally_and_pass_nothing_invalid_to_a_worker(scheduler):
    process, worker = scheduler
    submit = SCHEDULER.methods_by_name["Submit"]

    @FUZZ
    @given(near_valid_submits() | messages(submit.input_type) | _RAW)
    @example(_valid_submit("fuzz-whole-pool", max_new_tokens=WHOLE_POOL))  # reserves the pool until it finishes
    @example(_valid_submit("fuzz-baseline"))  # always run: proves an accepted Submit reaches the worker intact
    @example(_valid_submit("fuzz-spec", spec=NOT_UTF8_SPEC))
    @example(_valid_submit("fuzz-sampling", sampling_params=NOT_UTF8_SAMPLING))
    def check(message):
        raw = message if isinstance(message, bytes) else message.SerializeToString()
        _call(process.channel, submit, raw, SCHEDULER)

    check()
    time.sleep(0.3)  # ASSIGNs in flight reach the fake worker
    assert process.process.poll() is None, process.output()
    assert worker.malformed == 0, f"the scheduler sent a worker something wire.decode refuses: {worker.errors[:3]}"
    assert worker.assigned, "no fuzzed Submit was accepted: the property was not exercised"
    for assign in worker.assigned:  # what a worker would run: sampling values it accepts, a prompt
        assert isinstance(assign.spec.sampling, SamplingParams)
        assert assign.spec.prompt_ids


def test_fuzzed_submit_batches_get_an_outcome_each_and_never_fail_internally(scheduler):
    """SubmitStream: every request of a batch gets its own outcome, none INTERNAL, and a batch that is
    not a valid message ends the call INVALID_ARGUMENT; what it queues reaches the worker intact."""
    process, worker = scheduler
    method = SCHEDULER.methods_by_name["SubmitStream"]
    submits = near_valid_submits() | messages(scheduler_pb2.SubmitRequest.DESCRIPTOR)
    hints = messages(scheduler_pb2.PrepareAdapterRequest.DESCRIPTOR)

    @FUZZ
    @given(st.lists(submits, max_size=6), st.lists(hints, max_size=2))
    @example([_valid_submit("stream-baseline")], [])
    @example([_valid_submit("stream-spec", spec=NOT_UTF8_SPEC), _valid_submit("stream-ok")], [])
    def check(requests, hints):
        batch = scheduler_pb2.SubmitStreamRequest(requests=requests, hints=hints)
        replies = list(process.stub.SubmitStream(iter([batch]), timeout=DEADLINE_S))
        assert [len(r.outcomes) for r in replies] == [len(requests)]
        outcomes = replies[0].outcomes
        assert [o.request_id for o in outcomes] == [r.request_id for r in requests]
        for outcome in outcomes:
            assert outcome.status not in ("INTERNAL", "UNKNOWN"), f"{outcome.status}: {outcome.message}"
            assert (outcome.status == "OK") == bool(outcome.queued.instance), outcome

    check()
    _call(process.channel, method, b"\x0a\x03\xff\xfe\x00", SCHEDULER)  # not a SubmitStreamRequest
    time.sleep(0.3)  # ASSIGNs in flight reach the fake worker
    assert process.process.poll() is None, process.output()
    assert worker.malformed == 0, f"the scheduler sent a worker something wire.decode refuses: {worker.errors[:3]}"
    assert any(a.spec.request_id == "stream-baseline" for a in worker.assigned)


@pytest.mark.parametrize("method", ["Cancel", "GetClusterState", "PrepareAdapter"])
def test_the_schedulers_other_rpcs_never_fail_internally(scheduler, method):
    process, _ = scheduler
    descriptor = SCHEDULER.methods_by_name[method]

    @FUZZ
    @given(messages(descriptor.input_type) | _RAW)
    def check(message):
        raw = message if isinstance(message, bytes) else message.SerializeToString()
        _call(process.channel, descriptor, raw, SCHEDULER)

    check()
    assert process.process.poll() is None, process.output()


def test_a_submit_without_a_prompt_is_refused_before_any_worker_sees_it(scheduler):
    process, worker = scheduler
    with pytest.raises(grpc.RpcError) as refused:
        process.stub.Submit(scheduler_pb2.SubmitRequest(request_id="empty", reply_to="tcp://127.0.0.1:9"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("prompt_ids: must hold 1-")
    assert "empty" not in [a.spec.request_id for a in worker.assigned]


STORE = adapter_store_pb2.DESCRIPTOR.services_by_name["AdapterStore"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-root")
    (root / "team").mkdir()
    process = StoreProcess(
        tmp_path_factory.mktemp("store"), "--model", str(DEMO_MODEL_DIR), "--adapter-root", str(root)
    )
    try:
        yield process.wait_serving()
    finally:
        process.stop()


@pytest.mark.parametrize("method", list(STORE.methods), ids=lambda m: m.name)
def test_the_stores_rpcs_never_fail_internally(store, method):
    """Every RPC of the adapter store's own service (the gateway's proxy aside): random typed requests and
    raw bytes get a status, never INTERNAL or UNKNOWN, and the store serves on."""

    @FUZZ
    @given(messages(method.input_type) | _RAW)
    def check(message):
        raw = message if isinstance(message, bytes) else message.SerializeToString()
        _call(store.channel, method, raw, STORE, first_only=True)

    check()
    assert store.proc.poll() is None, store.output()
    reply = store.health.Check(health_pb2.HealthCheckRequest(service=STORE.full_name), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
