"""Many emulated workers in one process, speaking the worker wire protocol to a real scheduler.

    python -m loraserve.bench.suites.control_plane.workers --scheduler tcp://127.0.0.1:7101 --workers 64 \\
        --adapters 10000 --out /tmp/cp/workers.json

For the control-plane measurement (`bench/suites/control_plane/suite.py`): what the scheduler sees is exactly
what `--workers` real workers would send — one DEALER socket per worker with its id, a
`WorkerReport` after every step (every `--step-s` while it holds requests, every 0.25 s when idle)
with its running and waiting requests, those that finished, its resident adapters (least recently
used first, at most `--resident` of them; as a real worker does, only when the set changed, and every
2 s in any case: `ResidentNews`) and a measured step sample — but no engine runs: an
assigned request runs for `max_new_tokens` steps, its adapter becomes resident (the oldest one
leaves), and a step takes `--step-s`. One thread serves every worker, so 64 of them cost one
process and a fraction of a core.

For every ASSIGN it records the decision latencies: `queued_s` (the scheduler's own: the request
queued → its ASSIGN sent, measured inside the scheduler) and end to end (the client's Submit sent →
this ASSIGN received, from `Assign.spec.arrival`, which the client sets to its send time). Per phase
(the request id's prefix up to its first '/'), written to `--out` as JSON when it is told to stop
(SIGTERM or SIGINT).
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from loraserve.bench.common.settings import add_settings
from loraserve.config_cli import setting
from loraserve.sockets import make_socket, send
from loraserve.wire import Assign, Cancel, ResidentNews, WireError, WorkerReport, decode

IDLE_REPORT_S = 0.25
TOTAL_PAGES = 65536
TOKENS_PER_PAGE = 16


@dataclass
class FakeWorker:
    worker_id: str
    socket: zmq.Socket
    max_batch: int
    resident_max: int
    running: dict[str, int] = field(default_factory=dict)  # request id -> steps left
    pages: dict[str, int] = field(default_factory=dict)  # request id -> KV pages
    resident: OrderedDict[tuple[str, int], None] = field(default_factory=OrderedDict)  # LRU first
    finished: list[str] = field(default_factory=list)
    next_report: float = 0.0
    steps: int = 0
    resident_news: ResidentNews = field(default_factory=ResidentNews)  # as a real worker reports it

    def assign(self, message: Assign) -> None:
        spec = message.spec
        steps = spec.sampling.max_new_tokens
        self.running[spec.request_id] = steps
        self.pages[spec.request_id] = -(-(len(spec.prompt_ids) + steps) // TOKENS_PER_PAGE)
        if spec.adapter:
            key = (spec.adapter, spec.adapter_version)
            self.resident[key] = None
            self.resident.move_to_end(key)
            while len(self.resident) > self.resident_max:
                self.resident.popitem(last=False)

    def cancel(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.running.pop(request_id, None) is not None:
                self.pages.pop(request_id, None)
                self.finished.append(request_id)

    def step(self) -> int:
        """One decode step over the batch: each request makes a token; those at their budget finish."""
        self.steps += 1
        for request_id in list(self.running):
            self.running[request_id] -= 1
            if self.running[request_id] <= 0:
                del self.running[request_id]
                self.pages.pop(request_id, None)
                self.finished.append(request_id)
        return len(self.running)

    def report(self, step_s: float, batch: int) -> WorkerReport:
        kv = sum(self.pages.values())
        ids = list(self.running)
        report = WorkerReport(
            worker_id=self.worker_id,
            ready=True,
            max_batch_size=self.max_batch,
            total_pages=TOTAL_PAGES,
            free_pages=TOTAL_PAGES - kv,
            kv_pages=kv,
            adapter_pages=0,
            running=ids[: self.max_batch],
            waiting=ids[self.max_batch :],
            resident=self.resident_news.news(list(self.resident), time.monotonic()),
            finished=self.finished,
            tokens_per_page=TOKENS_PER_PAGE,
            steps=self.steps,
            instance=f"fake-{self.worker_id}",
            step_samples=[(batch, 16 * batch, min(batch, 8), kv, step_s)] if batch else [],
        )
        self.finished = []
        return report


@dataclass
class Latencies:
    queued_s: list[float] = field(default_factory=list)  # inside the scheduler
    end_to_end_s: list[float] = field(default_factory=list)  # client Submit sent -> ASSIGN received
    first_s: float | None = None  # when this phase's first and last ASSIGN arrived (unix)
    last_s: float = 0.0


class Driver:
    def __init__(self, scheduler: str, workers: int, adapters: int, resident: int, max_batch: int, step_s: float):
        self.ctx = zmq.Context()
        self.step_s = step_s
        self.workers: list[FakeWorker] = []
        for i in range(workers):
            sock = make_socket(self.ctx, zmq.DEALER, connect=scheduler, identity=f"worker-{i}")
            worker = FakeWorker(f"worker-{i}", sock, max_batch, resident)
            for j in range(resident):  # a start: a different slice of the catalogue on each worker
                worker.resident[(f"cp-{(i * resident + j) % adapters:05d}", 1)] = None
            worker.next_report = time.monotonic() + i * IDLE_REPORT_S / workers  # staggered
            self.workers.append(worker)
        self.by_socket = {w.socket: w for w in self.workers}
        self.phases: dict[str, Latencies] = {}
        self.assigned = 0

    def run(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        for w in self.workers:
            poller.register(w.socket, zmq.POLLIN)
        while not stop.is_set():
            now = time.monotonic()
            wait_s = max(0.0, min(w.next_report for w in self.workers) - now)
            for sock, _ in poller.poll(min(50, int(wait_s * 1000) + 1)):
                self._drain(self.by_socket[sock])
            now = time.monotonic()
            for w in self.workers:
                if now >= w.next_report:
                    batch = w.step() if w.running else 0
                    send(w.socket, w.report(self.step_s, batch))
                    w.next_report = now + (self.step_s if w.running else IDLE_REPORT_S)

    def _drain(self, worker: FakeWorker) -> None:
        while True:
            try:
                frames = worker.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            received = time.time()
            try:
                message = decode(frames)
            except WireError:
                continue
            if isinstance(message, Assign):
                self._record(message, received)
                worker.assign(message)
                worker.next_report = min(worker.next_report, time.monotonic() + self.step_s)  # idle: it steps now
            elif isinstance(message, Cancel):
                worker.cancel(list(message.request_ids))

    def _record(self, message: Assign, received: float) -> None:
        phase = self.phases.setdefault(message.spec.request_id.split("/", 1)[0], Latencies())
        phase.queued_s.append(message.queued_s)
        phase.end_to_end_s.append(received - message.spec.arrival)
        phase.first_s = phase.first_s or received
        phase.last_s = received
        self.assigned += 1

    def summary(self) -> dict:
        return {
            "workers": len(self.workers),
            "assigned": self.assigned,
            "phases": {
                name: {
                    "assigned": len(p.queued_s),
                    "first_unix": p.first_s,
                    "last_unix": p.last_s,
                    "queued_s": [round(x, 6) for x in p.queued_s],
                    "end_to_end_s": [round(x, 6) for x in p.end_to_end_s],
                }
                for name, p in self.phases.items()
            },
        }

    def close(self) -> None:
        for w in self.workers:
            w.socket.close(linger=0)
        self.ctx.term()


@dataclass(frozen=True, kw_only=True)
class WorkersSettings:
    """The emulated workers' flags (the control-plane suite starts this process with them)."""

    scheduler: str = setting(help="the scheduler's worker address (tcp://...)", required=True)
    workers: int = setting(64, "emulated workers")
    adapters: int = setting(10_000, "the catalogue the resident sets start from")
    resident: int = setting(128, "adapters resident per worker")
    max_batch_size: int = setting(64, "running requests per worker")
    step_s: float = setting(0.02, "a step's duration while a worker holds requests")
    out: Path = setting(help="where the latencies go, as JSON, when told to stop", required=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_settings(p, WorkersSettings)
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    driver = Driver(args.scheduler, args.workers, args.adapters, args.resident, args.max_batch_size, args.step_s)
    try:
        driver.run(stop)
    finally:
        args.out.write_text(json.dumps(driver.summary()) + "\n")
        driver.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
