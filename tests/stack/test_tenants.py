"""Tenants end to end: a stack with an auth file, real processes, a real gRPC client.

One stack serves the whole module. Tenants: `a` and `b` (own adapters), `viewer` (generate only),
`ops` (admin), `q` (one generation at a time) and `t` (30 tokens a minute, prompt and output).
"""

from __future__ import annotations

import hashlib
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from stack import LocalStack, free_port_block

from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.slow
KEYS = {name: f"key-of-{name}-0123456789" for name in ("a", "b", "viewer", "ops", "q", "t")}
SCOPES = {"a": "adapters", "b": "adapters", "viewer": "generate", "ops": "admin", "q": "generate", "t": "generate"}
QUOTAS = {"q": "max_concurrent = 1", "t": "tokens_per_minute = 30"}
SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["LoraServe"]
GREEDY = {"text": "the quiet king", "max_new_tokens": 12}


def auth_file_text(keys: dict[str, str]) -> str:
    return "".join(
        f'[[tenants]]\nname = "{name}"\napi_key_sha256 = ["{hashlib.sha256(key.encode()).hexdigest()}"]\n'
        f'scopes = ["{SCOPES.get(name, "generate")}"]\n{QUOTAS.get(name, "")}\n\n'
        for name, key in keys.items()
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    auth = tmp_path_factory.mktemp("auth") / "auth.toml"
    auth.write_text(auth_file_text(KEYS))
    metrics_port = free_port_block(4)
    stack = LocalStack(
        DEMO_MODEL_DIR,
        workers=1,
        auth_file=str(auth),
        adapter_root=str(next(iter(demo_adapters().values())).parent),
        metrics_port=metrics_port,
    )
    stack.auth_path, stack.metrics_port = auth, metrics_port
    stack.start()
    stack.wait_workers(1)
    yield stack
    stack.stop()


def md(tenant: str | None = None, key: str | None = None) -> tuple[tuple[str, str], ...]:
    key = key if key is not None else KEYS[tenant]
    return (("authorization", f"Bearer {key}"),)


def generate(stack, tenant, timeout=60, **fields):
    return stack.api.Generate(gateway_pb2.GenerateRequest(**fields), timeout=timeout, metadata=md(tenant))


def upload(stack, tenant: str, name: str, demo: str):
    path = demo_adapters()[demo]

    def messages():
        yield gateway_pb2.UploadAdapterRequest(header=gateway_pb2.UploadHeader(name=name))
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            yield gateway_pb2.UploadAdapterRequest(
                chunk=gateway_pb2.FileChunk(file=file, data=(path / file).read_bytes())
            )

    return stack.api.UploadAdapter(messages(), timeout=60, metadata=md(tenant))


def code_of(call, *args) -> grpc.StatusCode:
    return error_of(call, *args).code()


def error_of(call, *args) -> grpc.RpcError:
    """The error `call(*args)` fails with."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    return info.value


def names(stack, tenant) -> dict[str, str]:
    """{name: owner} of what `tenant` lists."""
    adapters = stack.api.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=5, metadata=md(tenant)).adapters
    return {a.name: a.owner for a in adapters}


def test_every_rpc_but_health_and_reflection_needs_a_valid_key(stack):
    for metadata in ((), md(key="not-a-key"), (("authorization", KEYS["a"]),)):  # none, wrong, no "Bearer"
        for method in SERVICE.methods:
            request = message_factory.GetMessageClass(method.input_type)()
            response = message_factory.GetMessageClass(method.output_type)
            path = f"/{SERVICE.full_name}/{method.name}"
            streams = (
                "stream" if method.client_streaming else "unary",
                "stream" if method.server_streaming else "unary",
            )
            call = getattr(stack.channel, "_".join(streams))(
                path, request_serializer=type(request).SerializeToString, response_deserializer=response.FromString
            )
            arg = iter([request]) if method.client_streaming else request
            code = code_of(_invoke, call, arg, metadata, method.server_streaming)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (method.name, metadata)
    health = health_pb2_grpc.HealthStub(stack.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(stack.channel)
    (answer,) = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    assert SERVICE.full_name in {s.name for s in answer.list_services_response.service}


def _invoke(call, request, metadata, server_streaming: bool) -> None:
    result = call(request, timeout=10, metadata=metadata)
    if server_streaming:
        list(result)


def test_scopes_bound_what_each_tenant_may_do(stack):
    assert generate(stack, "viewer", adapter="upper", **GREEDY).usage.completion_tokens > 0
    assert stack.api.Tokenize(gateway_pb2.TokenizeRequest(text="hi"), timeout=5, metadata=md("viewer")).ids
    assert stack.api.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5, metadata=md("viewer")).vocab_size
    assert "upper" in names(stack, "viewer")
    denied = grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: upload(stack, "viewer", "mine", "upper")) == denied
    register = gateway_pb2.RegisterAdapterFromPathRequest(name="mine", path="upper")
    assert code_of(lambda: stack.api.RegisterAdapterFromPath(register, timeout=10, metadata=md("viewer"))) == denied
    delete = gateway_pb2.DeleteAdapterRequest(name="upper")
    assert code_of(lambda: stack.api.DeleteAdapter(delete, timeout=10, metadata=md("viewer"))) == denied
    # `adapters`: its own adapters, never a public one
    info = stack.api.RegisterAdapterFromPath(register, timeout=30, metadata=md("a"))
    assert (info.name, info.owner) == ("mine", "a")
    assert code_of(lambda: stack.api.DeleteAdapter(delete, timeout=10, metadata=md("a"))) == denied
    mine = gateway_pb2.DeleteAdapterRequest(name="mine")
    assert stack.api.DeleteAdapter(mine, timeout=10, metadata=md("a")).version == info.version
    # `admin`: public adapters, and any tenant's by TENANT~NAME
    public = upload(stack, "ops", "shared", "title")
    assert (public.name, public.owner) == ("shared", "")
    assert names(stack, "a")["shared"] == "" and names(stack, "b")["shared"] == ""
    placed = upload(stack, "ops", "b~gift", "snake")
    assert (placed.name, placed.owner) == ("b~gift", "b")
    assert names(stack, "b")["gift"] == "b" and "gift" not in names(stack, "a")
    assert names(stack, "ops")["b~gift"] == "b"
    by_admin = generate(stack, "ops", adapter="b~gift", **GREEDY)
    assert by_admin.token_ids == generate(stack, "b", adapter="gift", **GREEDY).token_ids
    gift = gateway_pb2.DeleteAdapterRequest(name="b~gift")
    assert stack.api.DeleteAdapter(gift, timeout=10, metadata=md("ops")).version == placed.version
    assert "gift" not in names(stack, "b")


def test_tenants_own_adapters_of_the_same_name_and_cannot_see_each_others(stack):
    a_style, b_style = upload(stack, "a", "style", "upper"), upload(stack, "b", "style", "rot13")
    assert (a_style.name, a_style.owner, b_style.owner) == ("style", "a", "b")
    for tenant, demo in (("a", "upper"), ("b", "rot13")):
        mine = generate(stack, tenant, adapter="style", **GREEDY)
        assert mine.token_ids == generate(stack, tenant, adapter=demo, **GREEDY).token_ids, tenant
    assert upload(stack, "a", "style", "upper").version == a_style.version + 1  # re-upload: a new version
    assert generate(stack, "b", adapter="style", **GREEDY).adapter_version == b_style.version  # b's untouched

    upload(stack, "a", "secret", "reverse")
    assert names(stack, "a")["secret"] == "a" and "secret" not in names(stack, "b")
    not_found = grpc.StatusCode.NOT_FOUND
    calls = {
        "generate": lambda name: generate(stack, "b", adapter=name, **GREEDY),
        "describe": lambda name: stack.api.DescribeAdapter(
            gateway_pb2.DescribeAdapterRequest(name=name), timeout=5, metadata=md("b")
        ),
        "delete": lambda name: stack.api.DeleteAdapter(
            gateway_pb2.DeleteAdapterRequest(name=name), timeout=5, metadata=md("b")
        ),
    }
    for what, call in calls.items():
        hidden, missing = error_of(call, "secret"), error_of(call, "nothere")
        assert hidden.code() == missing.code() == not_found, what
        assert hidden.details().replace("secret", "X") == missing.details().replace("nothere", "X"), what
    assert names(stack, "a")["secret"] == "a", "b's delete must not touch a's adapter"
    assert code_of(lambda: generate(stack, "b", adapter="a~secret", **GREEDY)) == grpc.StatusCode.INVALID_ARGUMENT

    describe = calls["describe"]
    timings: dict[str, list[float]] = {"secret": [], "nothere": []}
    for _ in range(25):
        for name, samples in timings.items():
            start = time.perf_counter()
            with pytest.raises(grpc.RpcError):
                describe(name)
            samples.append(time.perf_counter() - start)
    hidden, missing = (statistics.median(timings[n]) for n in ("secret", "nothere"))
    assert abs(hidden - missing) < max(0.004, 0.5 * max(hidden, missing)), (hidden, missing)


def test_quota_overruns_are_resource_exhausted_and_leave_other_tenants_alone(stack):
    long = gateway_pb2.GenerateRequest(
        text="the quiet king", max_new_tokens=400, sampling=common_pb2.SamplingParameters(ignore_eos=True)
    )
    running = stack.api.GenerateStream(long, timeout=60, metadata=md("q"))
    next(running)  # q's one slot is taken while this stream runs
    results: list = []
    others = [
        threading.Thread(target=lambda: results.append(generate(stack, "a", adapter="upper", **GREEDY)))
        for _ in range(2)
    ]
    for thread in others:
        thread.start()
    refused = error_of(lambda: generate(stack, "q", **GREEDY))
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent" in refused.details()
    assert int(dict(refused.trailing_metadata())["retry-after-ms"]) > 0
    for thread in others:
        thread.join(timeout=60)
    assert len(results) == 2 and all(r.usage.completion_tokens > 0 for r in results)
    running.cancel()
    deadline = time.monotonic() + 10
    while True:  # the slot frees once the gateway sees the cancel
        try:
            assert generate(stack, "q", **GREEDY).usage.completion_tokens > 0
            break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.1)

    # t's 30 tokens a minute: a request costs its prompt (4 tokens) + max_new_tokens, charged at admission.
    ignore_eos = common_pb2.SamplingParameters(ignore_eos=True)
    never = error_of(lambda: generate(stack, "t", text="the quiet king", max_new_tokens=40))  # 44 > 30
    assert never.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "can never be admitted" in never.details()
    assert "retry-after-ms" not in dict(never.trailing_metadata())  # waiting would not help
    assert (
        generate(stack, "t", text="the quiet king", max_new_tokens=20, sampling=ignore_eos).usage.completion_tokens
        == 20
    )
    over = error_of(lambda: generate(stack, "t", **GREEDY))  # 16 more, 6 left
    assert over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens_per_minute = 30" in over.details()
    assert int(dict(over.trailing_metadata())["retry-after-ms"]) > 5_000  # 10 tokens short at 0.5 a second
    assert generate(stack, "viewer", **GREEDY).usage.completion_tokens > 0


def test_requests_are_counted_by_tenant(stack):
    from prometheus_client.parser import text_string_to_metric_families

    with pytest.raises(grpc.RpcError):
        stack.api.Generate(gateway_pb2.GenerateRequest(**GREEDY), timeout=5, metadata=md(key="wrong"))
    generate(stack, "viewer", **GREEDY)
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    counted = {
        (s.labels["code"], s.labels["tenant"])
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "loraserve_gateway_requests_total"
    }
    assert {("UNAUTHENTICATED", "unauthenticated"), ("OK", "viewer")} <= counted
    assert not any(key in text for key in KEYS.values())


def test_sighup_adds_and_revokes_keys_live_and_keys_new_round_trips(stack):
    out = subprocess.run(
        [sys.executable, "-m", "loraserve.cli", "keys", "new", "--tenant", "newbie", "--scopes", "generate"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    key = out.splitlines()[1].strip()
    table = out[out.index("[[tenants]]") :]
    original = stack.auth_path.read_text()
    gateway = stack.process("gateway")
    stream = stack.api.GenerateStream(
        gateway_pb2.GenerateRequest(text="the quiet king", max_new_tokens=60), timeout=60, metadata=md("viewer")
    )
    assert next(stream).HasField("chunk"), "the stream is admitted and running before the key is revoked"
    try:
        stack.auth_path.write_text(auth_file_text({n: k for n, k in KEYS.items() if n != "viewer"}) + table)
        gateway.send_signal(signal.SIGHUP)
        assert _eventually(lambda: _works(stack, key)), "the new key must work after SIGHUP"
        assert not _works(stack, KEYS["viewer"]), "the removed key must stop working"
        assert any(e.HasField("summary") for e in stream), "a stream already running finishes"

        stack.auth_path.write_text("[[tenants]]\nname = 'broken'\n")  # a bad file keeps the current keys
        gateway.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert gateway.poll() is None and _works(stack, key)
    finally:
        stack.auth_path.write_text(original)
        gateway.send_signal(signal.SIGHUP)
    assert _eventually(lambda: _works(stack, KEYS["viewer"]))


def _works(stack, key: str) -> bool:
    try:
        stack.api.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5, metadata=md(key=key))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
        return False
    return True


def _eventually(check, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def test_an_open_gateway_refuses_a_public_bind():
    port = free_port_block(1)
    command = [sys.executable, "-m", "loraserve.cli", "gateway", "--bind", f"0.0.0.0:{port}"]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "--auth-file" in done.stderr and "--insecure-no-auth" in done.stderr, done.stderr[-2000:]
