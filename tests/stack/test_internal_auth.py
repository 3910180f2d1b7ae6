"""Authenticated internal planes: only the stack's own roles use its internal ports.

One stack started by the launcher (which makes the internal keys) on the demo model. Strangers try
what an attacker on the network would: register as a worker on the scheduler's ZMQ port (no CURVE
keys, keys of their own, and a real key of the wrong role), call the scheduler's and the store's
gRPC ports without the internal token, fetch adapter bytes from the store's data port, and point a
Submit's `reply_to` at their own socket. Each is refused, and user traffic during and after the
attempts completes with the same tokens as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import subprocess
import sys
import time
import uuid

import grpc
import pytest
import zmq
import zmq.auth
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stack import LocalStack

from loraserve import errors, internal_auth
from loraserve.adapter_store.client import AdapterFetcher
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.grpc_token import server_interceptors
from loraserve.grpc_utils import internal_channel, new_server
from loraserve.internal_auth import Curve, InternalKeys
from loraserve.sockets import make_socket, send
from loraserve.v1 import adapter_store_pb2_grpc, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from loraserve.wire import WorkerReport, decode

pytestmark = pytest.mark.slow
PROMPT = gateway_pb2.GenerateRequest(adapter="upper", text="the quiet king", max_new_tokens=6)


@pytest.fixture(scope="module")
def stack():
    stack = LocalStack(DEMO_MODEL_DIR, 1, max_batch_size=8).start()
    stack.wait_workers(1)
    stack.baseline = list(stack.api.Generate(PROMPT, timeout=30).token_ids)
    yield stack
    stack.stop()


def _own_curve(server_key: bytes) -> Curve:
    public, secret = zmq.curve_keypair()
    return Curve(public, secret, server_key=server_key)


def _forged_report(worker_id: str) -> WorkerReport:
    return WorkerReport(
        worker_id=worker_id,
        ready=True,
        max_batch_size=64,
        total_pages=100_000,
        free_pages=100_000,
        kv_pages=0,
        adapter_pages=0,
        running=[],
        waiting=[],
        resident=[],
        instance=uuid.uuid4().hex,
    )


def _serves_as_before(stack: LocalStack, n: int = 6) -> None:
    for _ in range(n):
        reply = stack.api.Generate(PROMPT, timeout=30)
        assert list(reply.token_ids) == stack.baseline


def test_forged_worker_registrations_are_refused_and_get_no_requests(stack):
    keys = internal_auth.load(stack.internal_keys, "gateway")  # a real key, but not a worker's
    server_key = keys.public["scheduler"]
    ctx = zmq.Context()
    forgers = {
        "plain": None,
        "own-keys": _own_curve(server_key),
        "gateway-key": keys.client_of("scheduler"),
    }
    sockets = {
        name: make_socket(ctx, zmq.DEALER, connect=stack.ports.scheduler_workers, identity=f"forged-{name}", curve=c)
        for name, c in forgers.items()
    }
    try:
        for _ in range(8):  # keep claiming to be ready, as a live worker would
            for name, sock in sockets.items():
                with contextlib.suppress(zmq.Again):
                    send(sock, _forged_report(f"forged-{name}"), flags=zmq.NOBLOCK)
            time.sleep(0.1)
        _serves_as_before(stack)
        workers = [w.worker_id for w in stack.cluster().workers]
        assert workers == ["worker-0"], f"a forged worker registered: {workers}"
        for name, sock in sockets.items():
            assert not sock.poll(200), f"the {name} forger was sent something"
    finally:
        for sock in sockets.values():
            sock.close(linger=0)
        ctx.term()


def test_a_real_worker_key_is_what_the_scheduler_admits(stack):
    """The positive control of the test above: a peer holding the worker key does register."""
    keys = internal_auth.load(stack.internal_keys, "worker")
    ctx = zmq.Context()
    address, curve = stack.ports.scheduler_workers, keys.client_of("scheduler")
    sock = make_socket(ctx, zmq.DEALER, connect=address, identity="keyed-worker", curve=curve)
    report = _forged_report("keyed-worker")
    report.ready = False  # registered, but never given requests
    try:
        deadline = time.monotonic() + 10
        while "keyed-worker" not in [w.worker_id for w in stack.cluster().workers]:
            assert time.monotonic() < deadline, "a peer with the worker key was not admitted"
            send(sock, report)
            time.sleep(0.1)
    finally:
        report.fatal, report.draining = "test over", True
        send(sock, report)
        time.sleep(0.2)
        sock.close(linger=0)
        ctx.term()
    _serves_as_before(stack, 2)


@pytest.mark.parametrize("token", [None, "Bearer wrong", "Bearer "])
def test_internal_grpc_ports_refuse_calls_without_the_internal_token(stack, token):
    metadata = [("authorization", token)] if token is not None else None
    submit = scheduler_pb2.SubmitRequest(
        request_id="forged", prompt_ids=[1, 2, 3], max_new_tokens=4, reply_to="tcp://127.0.0.1:9"
    )
    with grpc.insecure_channel(stack.ports.scheduler) as sched, grpc.insecure_channel(stack.ports.store) as store:
        calls = {
            "Submit": lambda: scheduler_pb2_grpc.SchedulerStub(sched).Submit(submit, timeout=5, metadata=metadata),
            "SubmitStream": lambda: list(
                scheduler_pb2_grpc.SchedulerStub(sched).SubmitStream(
                    iter([scheduler_pb2.SubmitStreamRequest(requests=[submit])]), timeout=5, metadata=metadata
                )
            ),
            "GetClusterState": lambda: scheduler_pb2_grpc.SchedulerStub(sched).GetClusterState(
                scheduler_pb2.GetClusterStateRequest(), timeout=5, metadata=metadata
            ),
            "Describe": lambda: adapter_store_pb2_grpc.AdapterStoreStub(store).Describe(
                gateway_pb2.DescribeAdapterRequest(name="upper"), timeout=5, metadata=metadata
            ),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, refused.value.details())
            assert "internal token" in refused.value.details()
        for channel in (sched, store):  # probes stay open
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    _serves_as_before(stack, 2)


def test_adapter_bytes_go_to_workers_only(stack):
    keys = internal_auth.load(stack.internal_keys, "gateway")
    strangers = {"plain": None, "own-keys": _own_curve(keys.public["store"]), "gateway-key": keys.client_of("store")}
    for curve in strangers.values():
        fetcher = AdapterFetcher(stack.ports.store_data, timeout_s=1.0, curve=curve)
        with pytest.raises(errors.UnavailableError):
            fetcher.fetch_adapter("upper", 1)
    worker = internal_auth.load(stack.internal_keys, "worker")
    fetched = AdapterFetcher(stack.ports.store_data, timeout_s=10.0, curve=worker.client_of("store"))
    assert len(fetched.fetch_adapter("upper", 1).weights) > 0  # the same fetch with the worker key succeeds
    _serves_as_before(stack, 2)


def test_tokens_never_reach_a_reply_to_that_is_not_a_gateway(stack):
    """Even a caller holding the internal token cannot have tokens streamed to its own socket: a
    worker pushes only to a peer that proves it holds the gateway's secret key. The control: the same
    Submit to a socket that does hold it (as a gateway's sink) gets the tokens."""
    ctx = zmq.Context()
    gateway = internal_auth.load(stack.internal_keys, "gateway")
    auth = gateway.authenticator(ctx)  # admits the worker's key, as the gateway's sink does
    plain = make_socket(ctx, zmq.PULL, bind="tcp://127.0.0.1:*")
    public, secret = zmq.curve_keypair()
    impostor = make_socket(ctx, zmq.PULL, bind="tcp://127.0.0.1:*", curve=Curve(public, secret, domain="x"))
    legitimate = make_socket(ctx, zmq.PULL, bind="tcp://127.0.0.1:*", curve=gateway.server())
    try:
        with grpc.insecure_channel(stack.ports.scheduler) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            for i, sink in enumerate((plain, impostor, legitimate)):
                submit = scheduler_pb2.SubmitRequest(
                    request_id=f"redirected-{i}",
                    prompt_ids=[5, 6, 7],
                    max_new_tokens=4,
                    reply_to=sink.getsockopt_string(zmq.LAST_ENDPOINT),
                )
                stub.Submit(submit, timeout=5, metadata=stack.internal_metadata)
        _serves_as_before(stack, 3)
        assert legitimate.poll(30_000), "the control got no tokens: the path under test delivers nothing at all"
        assert decode(legitimate.recv_multipart()).request_id == "redirected-2"
        for sink in (plain, impostor):
            if sink.poll(1000):
                raise AssertionError(f"tokens reached a stranger's socket: {decode(sink.recv_multipart())}")
    finally:
        for sink in (plain, impostor, legitimate):
            sink.close(linger=0)
        auth.stop()
        ctx.term()


def test_generate_makes_private_secrets_and_keeps_existing_keys(tmp_path):
    internal_auth.generate(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert set(before) == {
        *(f"{r}.key" for r in internal_auth.ROLES),
        *(f"{r}.key_secret" for r in internal_auth.ROLES),
        internal_auth.TOKEN_FILE,
    }
    for name in before:
        if name.endswith("_secret") or name == internal_auth.TOKEN_FILE:
            assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600, name
    internal_auth.generate(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    worker = internal_auth.load(tmp_path, "worker")
    assert isinstance(worker, InternalKeys) and worker.token is None  # workers never hold the gRPC token
    assert internal_auth.load(tmp_path, "scheduler").token


def test_load_names_what_is_missing_or_wrong(tmp_path):
    with pytest.raises(errors.InvalidConfigError, match="not a directory"):
        internal_auth.load(tmp_path / "absent", "worker")
    internal_auth.generate(tmp_path)
    (tmp_path / "store.key_secret").write_bytes((tmp_path / "worker.key_secret").read_bytes())
    with pytest.raises(errors.InvalidConfigError, match=r"store\.key_secret does not match store\.key"):
        internal_auth.load(tmp_path, "store")
    (tmp_path / internal_auth.TOKEN_FILE).write_text("short\n")
    with pytest.raises(errors.InvalidConfigError, match="at least 32 characters"):
        internal_auth.load(tmp_path, "gateway")
    (tmp_path / "gateway.key").unlink()
    with pytest.raises(errors.InvalidConfigError, match=r"gateway\.key"):
        internal_auth.load(tmp_path, "worker")


def test_keys_internal_makes_a_directory_every_role_can_load(tmp_path):
    command = [sys.executable, "-m", "loraserve.cli", "keys", "internal"]
    made = subprocess.run(
        [*command, "--out", str(tmp_path / "k")], check=False, capture_output=True, text=True, timeout=60
    )
    assert made.returncode == 0, made.stderr
    assert "never need the token" in made.stdout
    for role in internal_auth.ROLES:
        internal_auth.load(tmp_path / "k", role)
    missing = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--out DIR is required" in missing.stderr


def test_the_token_goes_with_every_kind_of_call_and_its_absence_is_refused():
    """All four RPC kinds through a real server: grpc.aio files a client interceptor under one kind
    only, so each kind needs its own (the stream-unary Upload relay once went without the token)."""

    async def scenario() -> dict[str, list]:
        async def unary(request, context):
            return dict(context.invocation_metadata()).get("authorization", "").encode()

        async def streamed_in(requests, context):
            return b"".join([r async for r in requests])

        async def streamed_out(request, context):
            yield b"1"
            yield b"2"

        async def both(requests, context):
            async for r in requests:
                yield r

        handler = grpc.method_handlers_generic_handler(
            "t.S",
            {
                "UU": grpc.unary_unary_rpc_method_handler(unary),
                "SU": grpc.stream_unary_rpc_method_handler(streamed_in),
                "US": grpc.unary_stream_rpc_method_handler(streamed_out),
                "SS": grpc.stream_stream_rpc_method_handler(both),
            },
        )
        token = "t" * 43
        server, port = new_server("127.0.0.1:0", server_interceptors(token))
        server.add_generic_rpc_handlers((handler,))
        await server.start()
        outcomes: dict[str, list] = {}
        try:
            for label, channel_token in (("with", token), ("without", None), ("wrong", "w" * 43)):
                async with internal_channel(f"127.0.0.1:{port}", channel_token) as channel:
                    calls = {
                        "UU": lambda c=channel: c.unary_unary("/t.S/UU")(b"x", timeout=5),
                        "SU": lambda c=channel: c.stream_unary("/t.S/SU")(iter([b"a", b"b"]), timeout=5),
                        "US": lambda c=channel: _collect(c.unary_stream("/t.S/US")(b"x", timeout=5)),
                        "SS": lambda c=channel: _collect(c.stream_stream("/t.S/SS")(iter([b"a"]), timeout=5)),
                    }
                    for kind, call in calls.items():
                        try:
                            outcomes.setdefault(label, []).append((kind, await call()))
                        except grpc.aio.AioRpcError as e:
                            outcomes.setdefault(label, []).append((kind, e.code()))
        finally:
            await server.stop(None)
        return outcomes

    outcomes = asyncio.run(scenario())
    assert outcomes["with"] == [("UU", b"Bearer " + b"t" * 43), ("SU", b"ab"), ("US", [b"1", b"2"]), ("SS", [b"a"])]
    for label in ("without", "wrong"):
        assert outcomes[label] == [(k, grpc.StatusCode.UNAUTHENTICATED) for k in ("UU", "SU", "US", "SS")]


async def _collect(call) -> list:
    return [item async for item in call]
