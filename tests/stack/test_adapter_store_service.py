"""The adapter store as a real process: gRPC control plane, ZMQ data plane, health, reflection, signals."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import msgpack
import pytest
import zmq
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from store_proc import CHUNK, SERVICE, StoreProcess, files, upload, upload_requests

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.errors import NotFoundError
from loraserve.sockets import make_socket, send
from loraserve.v1 import adapter_store_pb2, gateway_pb2
from loraserve.wire import AdapterPayload, FetchAdapter, decode

RETENTION_S = 2.0
MAX_ADAPTER_MB = 2
BUDGET_MIB = 12


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("adapter-root")
    root = tmp / "root"
    (root / "team" / "upper").mkdir(parents=True)
    config, weights = files("upper")
    (root / "team" / "upper" / "adapter_config.json").write_bytes(config)
    (root / "team" / "upper" / "adapter_model.safetensors").write_bytes(weights)
    (tmp / "outside").mkdir()
    (root / "escape").symlink_to(tmp / "outside", target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def store(root: Path, tmp_path_factory) -> Iterator[StoreProcess]:
    process = StoreProcess(
        tmp_path_factory.mktemp("store-logs"),
        "--model",
        str(DEMO_MODEL_DIR),
        "--no-preload-demo",
        "--preload",
        f"pre={demo_adapters()['upper']}",
        "--adapter-root",
        str(root),
        "--retention-s",
        str(RETENTION_S),
        "--max-adapter-mb",
        str(MAX_ADAPTER_MB),
        "--memory-budget-gb",
        str(BUDGET_MIB / 1024),
    )
    try:
        yield process.wait_serving()
    finally:
        process.stop()


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


# ---- health, reflection ------------------------------------------------------------------------------
def test_health_and_reflection_answer(store):
    for service in ("", SERVICE):
        status = store.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(store.channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
    ]
    listed, described = list(reflection.ServerReflectionInfo(iter(requests), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    assert described.file_descriptor_response.file_descriptor_proto


def test_reflection_v1_answers_with_its_own_messages(store):
    """grpc.reflection.v1, as clients that ask for v1 only (grpcurl, grpcui) use it: its own proto,
    described by the server, builds the messages of a second call that lists and describes services."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    method = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
    call = store.channel.stream_stream(
        method,
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection")
    (described,) = list(call(iter([request]), timeout=5))
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in described.file_descriptor_response.file_descriptor_proto
    ]
    assert [(f.name, f.package) for f in files] == [("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")]
    pool = descriptor_pool.DescriptorPool()
    pool.Add(files[0])
    v1 = {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"grpc.reflection.v1.{name}"))
        for name in ("ServerReflectionRequest", "ServerReflectionResponse")
    }
    call = store.channel.stream_stream(
        method,
        request_serializer=v1["ServerReflectionRequest"].SerializeToString,
        response_deserializer=v1["ServerReflectionResponse"].FromString,
    )
    requests = [
        v1["ServerReflectionRequest"](list_services=""),
        v1["ServerReflectionRequest"](file_containing_symbol=SERVICE),
    ]
    listed, found = list(call(iter(requests), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= names
    assert found.file_descriptor_response.file_descriptor_proto


# ---- upload, describe, fetch ---------------------------------------------------------------------------
def test_preloaded_adapter_is_served(store):
    listed = {a.name: a for a in store.stub.List(gateway_pb2.ListAdaptersRequest(), timeout=5).adapters}
    assert listed["pre"].source == str(demo_adapters()["upper"]) and listed["pre"].version == 1
    config, weights = files("upper")
    got_config, got_weights, fmt = store.fetcher.fetch("pre", 1)
    assert (got_config, bytes(got_weights), fmt) == (config, weights, "safetensors")


def test_chunked_upload_is_described_and_fetched_byte_for_byte(store):
    import hashlib

    config, weights = files("reverse")
    info = upload(store, "rev", "reverse")
    assert (info.name, info.version, info.rank, info.source) == ("rev", 1, 32, "upload")
    assert list(info.target_modules) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert info.sha256 == hashlib.sha256(weights).hexdigest() and info.size_bytes == len(weights)
    assert store.stub.Describe(gateway_pb2.DescribeAdapterRequest(name="rev"), timeout=5) == info
    assert "rev" in [a.name for a in store.stub.List(gateway_pb2.ListAdaptersRequest(), timeout=5).adapters]
    got_config, got_weights, fmt = store.fetcher.fetch("rev", 1, trace={"traceparent": "00-bad"})
    assert got_config == config and bytes(got_weights) == weights and fmt == "safetensors"


def test_reupload_makes_a_new_version_and_the_old_one_stays_fetchable_for_the_retention(store):
    assert upload(store, "re", "title").version == 1
    assert upload(store, "re", "upper").version == 2
    assert store.stub.Describe(gateway_pb2.DescribeAdapterRequest(name="re"), timeout=5).version == 2
    assert bytes(store.fetcher.fetch("re", 1)[1]) == files("title")[1]
    assert bytes(store.fetcher.fetch("re", 2)[1]) == files("upper")[1]
    time.sleep(RETENTION_S + 0.5)
    with pytest.raises(NotFoundError, match="version 1 was released"):
        store.fetcher.fetch("re", 1)


def test_delete_then_the_name_is_gone_but_its_version_is_still_fetchable(store):
    upload(store, "gone", "upper")
    assert store.stub.Delete(gateway_pb2.DeleteAdapterRequest(name="gone"), timeout=5).version == 1
    error = refused(lambda: store.stub.Describe(gateway_pb2.DescribeAdapterRequest(name="gone"), timeout=5))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert store.fetcher.fetch("gone", 1)


def nan_weights() -> bytes:
    tensors = load_safetensors(files("upper")[1])
    tensors[sorted(tensors)[0]][0, 0] = float("nan")
    return save_safetensors(tensors)


CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.mark.parametrize(
    ("name", "parts", "code", "message"),
    [
        ("bad", [(CONFIG, b"{oops"), (WEIGHTS, None)], "INVALID_ARGUMENT", "adapter_config.json is not valid JSON"),
        ("bad", [(CONFIG, None), (WEIGHTS, "nan")], "INVALID_ARGUMENT", "contains NaN or infinite values"),
        (None, [(CONFIG, None), (WEIGHTS, None)], "INVALID_ARGUMENT", "header: missing"),
        ("bad", [("weights.pt", b"x")], "INVALID_ARGUMENT", "chunk.file: unknown file 'weights.pt'"),
        ("bad", [(CONFIG, None)], "INVALID_ARGUMENT", "adapter_model.safetensors: missing"),
        ("bad/name", [(CONFIG, None)], "INVALID_ARGUMENT", "header.name"),
        ("bad", [(CONFIG, b" " * (2**20 + 1))], "INVALID_ARGUMENT", "adapter_config.json: larger than 1048576"),
    ],
)
def test_malformed_uploads_are_refused_and_the_store_keeps_serving(store, name, parts, code, message):
    good_config, good_weights = files("upper")
    defaults = {CONFIG: good_config, WEIGHTS: good_weights}
    parts = [(f, nan_weights() if d == "nan" else defaults[f] if d is None else d) for f, d in parts]
    error = refused(lambda: store.stub.Upload(upload_requests(name, parts), timeout=30))
    assert error.code().name == code and message in error.details(), error.details()
    assert store.fetcher.fetch("pre", 1)[2] == "safetensors"
    assert "bad" not in [a.name for a in store.stub.List(gateway_pb2.ListAdaptersRequest(), timeout=5).adapters]


def test_an_oversized_upload_is_refused_mid_stream(store):
    sent = 0
    block = b"\0" * CHUNK

    def endless():
        nonlocal sent
        yield gateway_pb2.UploadAdapterRequest(header=gateway_pb2.UploadHeader(name="huge"))
        for _ in range(100 * 2**20 // CHUNK):  # 100 MiB if nobody stops us
            sent += 1
            yield gateway_pb2.UploadAdapterRequest(chunk=gateway_pb2.FileChunk(file=WEIGHTS, data=block))

    error = refused(lambda: store.stub.Upload(endless(), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # not worth retrying: RESOURCE_EXHAUSTED would be
    assert f"exceed the store's maximum adapter size of {MAX_ADAPTER_MB:.1f} MiB" in error.details()
    assert sent * CHUNK < 10 * 2**20  # refused as soon as it crossed the limit, not after reading it all


def test_over_budget_uploads_are_refused_and_deleted_versions_are_purged_after_the_retention(store):
    names = []
    for i in range(2 * BUDGET_MIB):  # 1.2 MiB each, under distinct names: only the budget can stop this
        try:
            upload(store, f"big-{i}", "reverse")
            names.append(f"big-{i}")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "host-RAM budget exhausted" in e.details()
            break
    else:
        pytest.fail("the memory budget was never reached")
    state = store.stub.GetStoreState(adapter_store_pb2.GetStoreStateRequest(), timeout=5)
    assert state.used_bytes <= state.budget_bytes == BUDGET_MIB * 2**20
    assert state.data_address == store.data_address
    for name in names:
        store.stub.Delete(gateway_pb2.DeleteAdapterRequest(name=name), timeout=5)
    assert store.fetcher.fetch(names[0], 1)  # deleted, still held for requests in flight
    time.sleep(RETENTION_S + 0.5)
    after = store.stub.GetStoreState(adapter_store_pb2.GetStoreStateRequest(), timeout=5)
    assert after.used_bytes <= state.used_bytes - len(names) * sum(map(len, files("reverse")))


# ---- paths, unknown names ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "code", "message"),
    [
        ("team/upper", "OK", ""),
        ("../outside", "INVALID_ARGUMENT", "contains '..'"),
        ("/etc", "INVALID_ARGUMENT", "is absolute"),
        ("escape", "PERMISSION_DENIED", "resolves outside the adapter root"),
        ("missing", "NOT_FOUND", "no such directory"),
    ],
)
def test_register_from_path_stays_inside_the_root(store, path, code, message):
    request = gateway_pb2.RegisterAdapterFromPathRequest(name="from-path", path=path)
    if code == "OK":
        info = store.stub.RegisterFromPath(request, timeout=10)
        assert (info.rank, info.source) == (4, "team/upper")
        return
    error = refused(lambda: store.stub.RegisterFromPath(request, timeout=10))
    assert error.code().name == code and message in error.details(), error.details()


def test_unknown_adapters_are_not_found(store):
    for call in (store.stub.Describe, store.stub.Delete):
        error = refused(lambda call=call: call(gateway_pb2.DescribeAdapterRequest(name="nope"), timeout=5))
        assert error.code() == grpc.StatusCode.NOT_FOUND and "'nope' is not registered" in error.details()
    with pytest.raises(NotFoundError, match="'nope' is not registered"):
        store.fetcher.fetch("nope", 1)


def test_malformed_zmq_messages_are_dropped_and_the_data_plane_keeps_serving(store):
    ctx = zmq.Context.instance()
    dealer = make_socket(ctx, zmq.DEALER, connect=store.data_address)
    try:
        dealer.send_multipart([b"\x63", b"junk"])  # unknown type
        dealer.send_multipart([b"\x06", b"\xc1"])  # not msgpack
        dealer.send_multipart([b"\x06", msgpack.packb({"name": "pre"})])  # missing version
        dealer.send_multipart([b"\x06", msgpack.packb({"name": "pre", "version": "1"})])  # wrong type
        dealer.send_multipart([b"\x06"])  # one frame
        send(dealer, FetchAdapter(name="pre", version=1, trace={"traceparent": 7}))  # trace values must be strings
        send(dealer, FetchAdapter(name="pre", version=1))
        assert dealer.poll(5000)
        reply = decode(dealer.recv_multipart())
        assert isinstance(reply, AdapterPayload) and (reply.name, reply.version) == ("pre", 1)
        assert not dealer.poll(200)  # nothing answered the junk
    finally:
        dealer.close()


# ---- defaults and stopping -------------------------------------------------------------------------------
def test_defaults_preload_the_demo_refuse_paths_and_sigterm_stops_cleanly(tmp_path):
    process = StoreProcess(tmp_path)  # demo model by default, no --adapter-root
    try:
        process.wait_serving()
        names = [a.name for a in process.stub.List(gateway_pb2.ListAdaptersRequest(), timeout=5).adapters]
        assert names == sorted(demo_adapters())
        request = gateway_pb2.RegisterAdapterFromPathRequest(name="x", path="x")
        error = refused(lambda: process.stub.RegisterFromPath(request, timeout=5))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no --adapter-root configured" in error.details()
        start = time.monotonic()
        process.proc.send_signal(signal.SIGTERM)
        assert process.proc.wait(10) == 0, process.output()
        assert time.monotonic() - start < 5
    finally:
        process.stop()
