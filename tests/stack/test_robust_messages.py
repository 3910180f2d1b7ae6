"""Malicious internal messages and dying tasks, against real processes.

A well-formed msgpack message with wrong element types once killed the scheduler's receive task
silently (finished=[[1]]) or crashed the scheduler later (resident=[1] then an adapter request);
a Submit with reply_to="not-an-endpoint" left a half-made socket that blocked `Context.term()`.
Now every message is checked against its schema, bad ones are dropped with a rate-limited
warning, and a task that dies takes its role down with NOT_SERVING and a non-zero exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import grpc
import msgpack
import msgspec
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from scheduler_proc import FakeWorker, SchedulerProcess, report

from loraserve.grpc_utils import add_health_and_reflection, new_server, set_serving
from loraserve.log_limit import RateLimitedLog
from loraserve.params import SamplingParams
from loraserve.request_spec import RequestSpec
from loraserve.sockets import BadEndpointError, PushSockets, make_socket, send
from loraserve.supervise import RoleFailed, supervise
from loraserve.v1 import scheduler_pb2
from loraserve.wire import Assign, MsgType, WireError, decode, encode

SINK = "tcp://127.0.0.1:9"  # a well-formed token sink nobody listens on: nothing is sent to it here


def _raw_report(**changes) -> list[bytes]:
    """A WorkerReport's frames with fields the encoder's types would never produce."""
    body = {**msgspec.structs.asdict(report("evil")), **changes}
    return [bytes([MsgType.WORKER_REPORT]), msgpack.packb(body)]


@pytest.fixture
def scheduler():
    process = SchedulerProcess(worker_timeout=1.0)
    try:
        process.wait_serving()
        yield process
    finally:
        process.stop()


def test_malicious_reports_and_submits_leave_the_scheduler_placing_requests(scheduler):
    worker = FakeWorker(scheduler.worker_address)
    ctx = zmq.Context()
    evil = make_socket(ctx, zmq.DEALER, connect=scheduler.worker_address, identity="evil")
    try:
        scheduler.wait_worker("w1")
        scheduler.submit("warm-up", SINK)
        worker.wait_assigned("warm-up")
        evil.send_multipart(_raw_report(finished=[[1]]))  # killed the receive task
        evil.send_multipart(_raw_report(resident=[1]))  # crashed the next adapter placement
        evil.send_multipart(_raw_report(waste_fraction=float("nan"), free_pages=-5))
        evil.send_multipart([bytes([MsgType.WORKER_REPORT]), b"\xc1"])
        time.sleep(1.5)  # past --worker-timeout: a dead receive task would have dropped the fake worker
        assert scheduler.process.poll() is None, scheduler.output()
        scheduler.submit("after", SINK, adapter="upper")
        assert worker.wait_assigned("after").spec.adapter == "upper"
        with pytest.raises(grpc.RpcError) as bad:
            scheduler.submit("bad-reply-to", "not-an-endpoint")
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "reply_to" in bad.value.details()
        with pytest.raises(grpc.RpcError) as bad:
            scheduler.submit("bad-deadline", SINK, deadline_unix=float("inf"))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        state = scheduler.stub.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=5)
        assert [w.worker_id for w in state.workers] == ["w1"], "no malformed report registered a worker"
        assert scheduler.status() == health_pb2.HealthCheckResponse.SERVING
    finally:
        evil.close(linger=0)
        ctx.term()
        worker.close()


# Raise in the receive path once the file exists: an unexpected bug, not a bad message.
_FAULT = """
import os
from loraserve.scheduler.policy import SchedulerPolicy
_on_report = SchedulerPolicy.on_report
def on_report(self, report, now):
    if os.path.exists({path!r}):
        raise RuntimeError("injected fault")
    return _on_report(self, report, now)
SchedulerPolicy.on_report = on_report
"""


def test_a_dead_task_makes_the_scheduler_not_serving_and_exit_nonzero(tmp_path):
    fault = tmp_path / "fault"
    scheduler = SchedulerProcess(prelude=_FAULT.format(path=str(fault)))
    ctx = zmq.Context()
    worker = make_socket(ctx, zmq.DEALER, connect=scheduler.worker_address, identity="w1")
    try:
        scheduler.wait_serving()
        fault.touch()
        send(worker, report("w1"))
        seen = set()
        deadline = time.monotonic() + 10
        while scheduler.process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(grpc.RpcError):
                seen.add(scheduler.status(timeout=0.5))
            time.sleep(0.02)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in seen, "health said NOT_SERVING before the exit"
        assert scheduler.process.wait(15) != 0
        output = scheduler.output()
        assert "injected fault" in output and "Traceback" in output
    finally:
        worker.close(linger=0)
        ctx.term()
        scheduler.stop()


def test_supervise_sets_not_serving_on_a_real_health_service_and_raises():
    async def scenario() -> tuple[int, int]:
        server, port = new_server("127.0.0.1:0")
        health = add_health_and_reflection(server, ["svc"])
        await server.start()
        await set_serving(health, ["svc"], True)

        async def dies():
            await asyncio.sleep(0.05)
            raise KeyError("boom")

        with pytest.raises(RoleFailed, match="boom"):
            await supervise(
                "role", {"ok": asyncio.sleep(60), "dies": dies()}, None, lambda: set_serving(health, ["svc"], False)
            )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())).status
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, stop.set)
        await supervise("role", {"ok": asyncio.sleep(60)}, stop, None)  # a stop is not a failure
        await server.stop(0)
        return status, health_pb2.HealthCheckResponse.NOT_SERVING

    status, expected = asyncio.run(scenario())
    assert status == expected


def test_a_bad_endpoint_never_leaves_a_socket_that_blocks_shutdown():
    """The worker and the scheduler connect to reply_to: a bad one must neither raise out nor wedge term()."""
    ctx = zmq.Context()
    for address in ("not-an-endpoint", "tcp://127.0.0.1:0", "tcp://*:5", "tcp://a;b:1", "ipc://", "udp://1.2.3.4:5"):
        with pytest.raises(BadEndpointError):
            make_socket(ctx, zmq.PUSH, connect=address)
    with pytest.raises(zmq.ZMQError):
        make_socket(ctx, zmq.PULL, bind="tcp://256.1.1.1:1")  # a failed bind closes its socket too
    sockets = PushSockets(ctx, size=2)
    with pytest.raises(BadEndpointError):
        sockets.get("not-an-endpoint")
    for port in (11, 12, 13):
        sockets.get(f"tcp://127.0.0.1:{port}")
    assert len(sockets._sockets) == 2, "the least recently used socket is closed"
    sockets.close(linger_ms=0)
    terminated = threading.Thread(target=ctx.term, daemon=True)
    terminated.start()
    terminated.join(3)
    assert not terminated.is_alive(), "Context.term() blocked on a half-made socket"


def test_the_worker_decoder_refuses_what_would_crash_or_wedge_a_worker():
    spec = RequestSpec(
        "r", [1], SamplingParams(max_new_tokens=2), "tcp://127.0.0.1:5", 1.0, adapter="a", adapter_version=1
    )
    good = Assign(spec)
    assert decode(encode(good)) == good
    bad = [
        {"reply_to": "not-an-endpoint"},
        {"sampling": {"max_new_tokens": 2, "no_such_field": 1}},
        {"sampling": {"max_new_tokens": 0}},
        {"sampling": {"temperature": -1e-40}},
        {"prompt_ids": [1, -1]},
        {"prompt_ids": [[1]]},
        {"deadline": float("nan")},
        {"request_id": "x" * 10_000},
        {"no_such_field": 1},
    ]
    fields = {**msgspec.structs.asdict(spec), "sampling": msgspec.structs.asdict(spec.sampling)}
    for changes in bad:
        with pytest.raises(WireError):
            decode([bytes([MsgType.ASSIGN]), msgpack.packb({"spec": {**fields, **changes}})])
    with pytest.raises(WireError, match="trace"):
        decode([bytes([MsgType.ASSIGN]), msgpack.packb({"spec": fields, "trace": {"traceparent": 5}})])


def test_a_flood_of_bad_messages_logs_a_few_lines_per_peer_and_kind(caplog):
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("flood"), period_s=10, burst=3, max_keys=4, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="flood"):
        logged = [limited.warning(b"peer", "malformed message", "dropped: %s", i) for i in range(1000)]
        limited.warning(b"other", "malformed message", "dropped")
        for i in range(100):  # ever-new identities: the table stays bounded
            limited.warning(f"p{i}", "malformed message", "x")
        now[0] = 11.0
        limited.warning(b"peer", "malformed message", "dropped: again")
    assert sum(logged) == 3
    assert len(limited._windows) <= 4
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == [f"malformed message from b'peer': dropped: {i}" for i in range(3)]
    assert "b'other'" in lines[3]
