"""Reports from many worker ids at once cost the scheduler a bounded amount of work and memory.

A holder of the worker key (here: a scheduler without internal keys, which anyone may reach) opens
50 connections, each reporting as its own worker id, and sends reports at every per-report bound as
fast as the sockets take them, while a real worker (`FakeWorker`) reports as usual. The scheduler's
loop reads a bounded number of them per turn and yields, so it keeps answering: health checks and
Submits (placed on the real worker) stay fast, its memory stays bounded (each connection queues a
bounded number of messages, the sender keeps the rest), and it is still up at the end. A connection
cannot report as another worker id (its routing identity is its id), and at most `--max-workers` ids
register (the test runs with the default, where all 50 register, and with 32, where the ids past it are
dropped before their reports are decoded).
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest
import zmq
from scheduler_proc import FakeWorker, SchedulerProcess, report

from loraserve.sockets import make_socket
from loraserve.v1 import scheduler_pb2
from loraserve.wire import MAX_BATCH, MAX_REPORTED_IDS, MAX_RESIDENT, encode

pytestmark = pytest.mark.slow

PEERS = 50
FLOOD_S = 8.0
SINK = "tcp://127.0.0.1:9"  # never read: the fake worker does not answer
# Bounds with room for a loaded machine: here a health check or Submit takes at most ~0.5 s (before the
# bounds per turn, the loop stalled past a 5 s deadline), and a Submit reaches the real worker within ~1.5 s
# (its reports wait their turn among 51 peers' for the placement to see it fresh).
ANSWER_S = 1.5
PLACEMENT_S = 4.0


def _at_bounds(worker_id: str, variant: int) -> list:
    """A report with every list as long as the wire allows (variants differ in every list)."""
    return encode(
        report(
            worker_id,
            max_batch_size=MAX_BATCH,
            running=[f"run-{variant}-{i}" for i in range(MAX_REPORTED_IDS)],
            waiting=[f"wait-{variant}-{i}" for i in range(MAX_REPORTED_IDS)],
            finished=[f"done-{variant}-{i}" for i in range(MAX_REPORTED_IDS)],
            resident=[[f"adapter-{variant}-{i:05d}", 1] for i in range(MAX_RESIDENT)],
            instance=worker_id,
        )
    )


class Flood:
    """PEERS connections, each with its own identity, sending at-bound reports on a thread until stopped."""

    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.peers = [
            make_socket(self.ctx, zmq.DEALER, connect=address, identity=f"flood-{i}", hwm=1000) for i in range(PEERS)
        ]
        self.reports = [[_at_bounds(f"flood-{i}", v) for v in range(2)] for i in range(PEERS)]
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            for sock, variants in zip(self.peers, self.reports, strict=True):
                with contextlib.suppress(zmq.Again):  # that peer's queue is full: the next one
                    sock.send_multipart(variants[n % 2], flags=zmq.NOBLOCK, copy=False)
                    self.sent += 1
            n += 1

    def stop(self) -> int:
        """Stop; how many reports were sent."""
        self._stop.set()
        self._thread.join(10)
        for sock in self.peers:
            sock.close(linger=0)
        self.ctx.term()
        return self.sent


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.parametrize("max_workers", [None, 32])  # None: the default (1024), every flooding id registers
def test_fifty_worker_ids_flooding_reports_neither_stall_nor_kill_the_scheduler(max_workers: int | None):
    flags = () if max_workers is None else ("--max-workers", str(max_workers))
    scheduler = SchedulerProcess(worker_timeout=5.0, flags=flags)
    worker = flood = None
    ctx = zmq.Context()
    impostor = make_socket(ctx, zmq.DEALER, connect=scheduler.worker_address, identity="impostor")
    slowest_health = slowest_submit = slowest_placement = peak_rss = 0.0
    try:
        scheduler.wait_serving()
        worker = FakeWorker(scheduler.worker_address)
        scheduler.wait_worker("w1")
        for worker_id in ("w1", "someone-else"):  # one connection speaking for other workers: refused
            impostor.send_multipart(_at_bounds(worker_id, 0), copy=False)
        time.sleep(0.5)
        flood = Flood(scheduler.worker_address)
        n = 0
        deadline = time.monotonic() + FLOOD_S
        while time.monotonic() < deadline:
            started = time.monotonic()
            assert scheduler.status(timeout=5.0) == 1  # SERVING
            slowest_health = max(slowest_health, time.monotonic() - started)
            started = time.monotonic()
            scheduler.submit(f"r{n}", SINK)
            slowest_submit = max(slowest_submit, time.monotonic() - started)
            worker.wait_assigned(f"r{n}", timeout_s=10.0)
            slowest_placement = max(slowest_placement, time.monotonic() - started)
            peak_rss = max(peak_rss, _rss_mib(scheduler.process.pid))
            n += 1
            time.sleep(0.1)
        flood_sent, flood = flood.stop(), None
        flood_ended = time.strftime("%H:%M:%S")  # the scheduler's log lines are stamped so
        state = scheduler.stub.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=5)
        registered = {w.worker_id for w in state.workers}
        assert scheduler.process.poll() is None, "the scheduler died"
    finally:
        if flood is not None:
            flood.stop()
        if worker is not None:
            worker.close()
        impostor.close(linger=0)
        ctx.term()
        scheduler.stop()
    log = scheduler.output()
    print(
        f"health {slowest_health:.2f} s, submit {slowest_submit:.2f} s, placement {slowest_placement:.2f} s, "
        f"{peak_rss:.0f} MiB, {flood_sent} reports sent"
    )
    assert flood_sent > 10 * PEERS, f"the flood sent only {flood_sent} reports"
    assert "w1" in registered and not registered & {"impostor", "someone-else"}, registered
    if max_workers is None:
        assert len(registered) == PEERS + 1, registered
    else:
        assert len(registered) == max_workers, f"--max-workers {max_workers}, yet {len(registered)} registered"
        assert f"refused: {max_workers} workers are registered (--max-workers)" in log, log[-3000:]
    assert "dropped: workers send only their own reports and heartbeats" in log, log[-3000:]
    during = "\n".join(line for line in log.splitlines() if line[:8] <= flood_ended)  # not its shutdown's
    assert "worker w1 stopped responding" not in during, "the real worker was dropped during the flood"
    assert slowest_health < ANSWER_S and slowest_submit < ANSWER_S, (slowest_health, slowest_submit)
    assert slowest_placement < PLACEMENT_S, f"a Submit took {slowest_placement:.2f} s to reach the real worker"
    assert peak_rss < 1024, f"the scheduler grew to {peak_rss:.0f} MiB"
