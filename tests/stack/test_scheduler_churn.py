"""Connection churn on the scheduler's worker port: thousands of plain TCP connect+close cycles (no
ZMTP handshake, no key) while a worker heartbeats. The scheduler must keep its worker and keep
placing requests promptly; a backlog of socket-monitor events once blocked ZMQ's I/O thread, and
with it every worker connection, for as long as the churn lasted and long after."""

from __future__ import annotations

import socket
import threading
import time

import zmq
from scheduler_proc import FakeWorker, SchedulerProcess

from loraserve.v1 import scheduler_pb2

CYCLES = 5000
MAX_PLACED = 60  # the fake worker never finishes a request; its reports say 64 slots


def _churn(host: str, port: int, cycles: int, done: threading.Event) -> None:
    try:
        for _ in range(cycles):
            with socket.create_connection((host, port), timeout=5):
                pass
    finally:
        done.set()


def test_connection_churn_on_the_worker_port_never_loses_the_worker_or_a_placement():
    scheduler = SchedulerProcess(worker_timeout=1.0)
    worker = None
    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    try:
        scheduler.wait_serving()
        worker = FakeWorker(scheduler.worker_address)
        scheduler.wait_worker("w1")
        reply_to = f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}"
        host, port = scheduler.worker_address.removeprefix("tcp://").rsplit(":", 1)
        done = threading.Event()
        threading.Thread(target=_churn, args=(host, int(port), CYCLES, done), daemon=True).start()
        waits = []
        while len(waits) < MAX_PLACED - 1 and not (done.is_set() and len(waits) >= 3):
            request_id = f"r{len(waits)}"
            scheduler.submit(request_id, reply_to)
            started = time.monotonic()
            worker.wait_assigned(request_id, timeout_s=3.0)
            waits.append(time.monotonic() - started)
            time.sleep(0.1)
        assert done.wait(60), "the churn did not finish"
        scheduler.submit("after", reply_to)
        worker.wait_assigned("after", timeout_s=3.0)
        state = scheduler.stub.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=5)
        assert [w.worker_id for w in state.workers if w.ready] == ["w1"]
        assert max(waits) < 1.0, waits
    finally:
        if worker is not None:
            worker.close()
        sink.close(0)
        ctx.term()
        scheduler.stop()
