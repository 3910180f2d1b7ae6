"""The scheduler's I/O loop on real ZMQ sockets: its own failure paths must not kill it."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from loraserve.scheduler.loop import SchedulerLoop
from loraserve.scheduler.policy import PolicyConfig, SchedulerPolicy
from loraserve.v1 import scheduler_pb2
from loraserve.wire import Tokens, WorkerReport, decode


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_failed_assign_then_the_worker_dropped_keeps_the_loop_alive(caplog):
    """A worker that reported once and then vanished: the ASSIGN cannot be sent (ROUTER_MANDATORY),
    the request fails to its gateway with UNAVAILABLE, and dropping the worker later is harmless."""

    async def scenario() -> Tokens:
        policy = SchedulerPolicy(PolicyConfig(worker_timeout_s=0.3))
        loop = SchedulerLoop(policy, f"tcp://127.0.0.1:{_free_port()}", tick_s=0.02)
        gateway = loop.ctx.socket(zmq.PULL)
        gateway.bind(sink := f"tcp://127.0.0.1:{_free_port()}")
        now = time.time()
        report = WorkerReport(
            worker_id="ghost",
            ready=True,
            max_batch_size=4,
            total_pages=100,
            free_pages=100,
            kv_pages=0,
            adapter_pages=0,
            running=[],
            waiting=[],
            resident=[],
        )
        policy.on_report(report, time.time())  # as if it had reported, then died (the loop keeps time.time())
        stop = asyncio.Event()
        task = asyncio.create_task(loop.run(stop))
        submit = scheduler_pb2.SubmitRequest(
            request_id="r1", prompt_ids=[1, 2], max_new_tokens=2, reply_to=sink, arrival_unix=now
        )
        loop.submit(submit, ())
        failure = decode(await asyncio.wait_for(gateway.recv_multipart(), 5))
        await asyncio.sleep(0.6)  # past worker_timeout_s: the ghost is dropped by a round
        assert not task.done(), task.exception() if task.done() else None
        assert "ghost" not in policy.workers
        gateway.close(0)  # before the loop terminates its context
        stop.set()
        await asyncio.wait_for(task, 5)
        return failure

    with caplog.at_level("WARNING", logger="loraserve.scheduler.loop"):
        failure = asyncio.run(scenario())
    assert "cannot reach worker ghost" in caplog.text  # the failed-send branch ran
    assert isinstance(failure, Tokens) and failure.finished and failure.error_status == "UNAVAILABLE"
