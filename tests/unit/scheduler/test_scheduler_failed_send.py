"""The scheduler's I/O loop on real ZMQ sockets: its own failure paths must not kill it."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import zmq
import zmq.asyncio
from scheduler_proc import report

from loraserve.scheduler import metrics
from loraserve.scheduler.loop import SchedulerLoop
from loraserve.scheduler.policy import PolicyConfig, SchedulerPolicy
from loraserve.scheduler.submit import spec_from_submit
from loraserve.v1 import scheduler_pb2
from loraserve.wire import Tokens, WorkerReport, decode

WORKER_TIMEOUT_S = 2.0  # far longer than the test: only a failed send can drop the ghost in time


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ghost_report() -> WorkerReport:
    return report("ghost", max_batch_size=4, total_pages=100, free_pages=100)


def test_a_failed_assign_drops_the_worker_at_once_and_keeps_the_loop_alive(caplog: pytest.LogCaptureFixture):
    """A worker that reported a moment ago but never connected: the scheduler places a request on
    it, the ASSIGN cannot be sent (ROUTER_MANDATORY), the worker is dropped at once (long before
    its report times out), the request goes back to the queue and, with no worker left, fails to
    its gateway with UNAVAILABLE; the loop lives on."""

    async def scenario() -> tuple[Tokens, float]:
        policy = SchedulerPolicy(PolicyConfig.of(worker_timeout_s=WORKER_TIMEOUT_S, stale_after_s=WORKER_TIMEOUT_S))
        loop = SchedulerLoop(policy, f"tcp://127.0.0.1:{_free_port()}", tick_s=0.02)
        gateway = loop.ctx.socket(zmq.PULL)
        gateway.bind(sink := f"tcp://127.0.0.1:{_free_port()}")
        policy.on_report(_ghost_report(), time.time())  # the loop's clock: a fresh report, placeable
        stop = asyncio.Event()
        task = asyncio.create_task(loop.run(stop))
        submit = scheduler_pb2.SubmitRequest(
            request_id="r1", prompt_ids=[1, 2], max_new_tokens=2, reply_to=sink, arrival_unix=time.time()
        )
        started = time.monotonic()
        loop.submit(spec_from_submit(submit, time.time()), 0, ())
        while "ghost" in policy.workers and time.monotonic() - started < WORKER_TIMEOUT_S / 2:
            await asyncio.sleep(0.01)
        dropped_after = time.monotonic() - started
        failure = decode(await asyncio.wait_for(gateway.recv_multipart(), 2 * WORKER_TIMEOUT_S))
        await asyncio.sleep(0.1)
        assert not task.done(), task.exception() if task.done() else None
        gateway.close(0)  # before the loop terminates its context
        stop.set()
        await asyncio.wait_for(task, 5)
        return failure, dropped_after

    assigned_before = metrics.ASSIGNED._value.get()
    with caplog.at_level(logging.WARNING, logger="loraserve.scheduler.loop"):
        failure, dropped_after = asyncio.run(scenario())
    # Only the failed-send branch (`_to_worker`'s except) logs these two lines, and drops the
    # worker before its report is stale.
    assert "cannot reach worker ghost" in caplog.text
    assert "worker ghost is unreachable" in caplog.text
    assert "stopped responding" not in caplog.text
    assert dropped_after < WORKER_TIMEOUT_S / 2
    assert metrics.ASSIGNED._value.get() == assigned_before  # the ASSIGN bounced: nothing was placed
    assert isinstance(failure, Tokens) and failure.finished and failure.error_status == "UNAVAILABLE"
    assert failure.request_id == "r1"
