"""A real scheduler process and a fake worker on a real ZMQ DEALER, for robustness tests.

The fake worker speaks the protocol exactly (a heartbeat WorkerReport every 0.1 s, ASSIGN
messages collected), so a test can check that the scheduler still places requests after it was
sent malicious messages, without paying for a model.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import grpc
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraserve.launcher.ports import free_port_block
from loraserve.sockets import make_socket, send
from loraserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from loraserve.wire import MAX_REPORTED_IDS, Assign, Prefetch, WireError, WorkerReport, decode


def report(worker_id: str, **changes) -> WorkerReport:
    fields = dict(
        worker_id=worker_id,
        ready=True,
        max_batch_size=64,
        total_pages=10_000,
        free_pages=10_000,
        kv_pages=0,
        adapter_pages=0,
        running=[],
        waiting=[],
        resident=[],
    )
    return WorkerReport(**{**fields, **changes})


class SchedulerProcess:
    """`loraserve scheduler` as a child process on free loopback ports."""

    def __init__(
        self, worker_timeout: float = 1.0, prelude: str = "", base_port: int | None = None, flags: tuple[str, ...] = ()
    ):
        base = base_port or free_port_block(2)  # a given one: a scheduler restarted where the last one was
        self.base_port = base
        self.grpc_address = f"127.0.0.1:{base}"
        self.worker_address = f"tcp://127.0.0.1:{base + 1}"
        args = [
            "--log-level",
            "WARNING",
            "scheduler",
            "--bind",
            self.grpc_address,
            "--worker-address",
            self.worker_address,
            "--worker-timeout",
            str(worker_timeout),
            *flags,
        ]
        # `prelude` runs first in the child (a test's fault injection), then the real CLI.
        code = f"import sys\n{prelude}\nfrom loraserve.cli import main\nsys.exit(main({args!r}))"
        # Its output goes to a file, not a pipe nobody reads while it runs: a scheduler that logs more than a
        # pipe holds would block in its next log call, and a test would read that as a wedged scheduler.
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (open while the process lives)
        self.process = subprocess.Popen([sys.executable, "-c", code], stdout=self._log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(self.grpc_address)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def status(self, timeout: float = 2.0):
        return self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout).status

    def wait_serving(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.output()
            try:
                if self.status() == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise TimeoutError("the scheduler did not become SERVING")

    def submit(self, request_id: str, reply_to: str, adapter: str = "", **fields) -> scheduler_pb2.SubmitResponse:
        request = scheduler_pb2.SubmitRequest(
            request_id=request_id,
            prompt_ids=[1, 2, 3],
            max_new_tokens=4,
            reply_to=reply_to,
            adapter=adapter,
            adapter_version=1 if adapter else 0,
            arrival_unix=time.time(),
            **fields,
        )
        return self.stub.Submit(request, timeout=5)

    def wait_worker(self, worker_id: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.stub.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=5)
            if any(w.worker_id == worker_id and w.ready for w in state.workers):
                return
            time.sleep(0.05)
        raise TimeoutError(f"worker {worker_id} did not register")

    def output(self) -> str:
        """What the scheduler has logged so far (it may still be running)."""
        self._log.seek(0)
        return self._log.read()

    def stop(self) -> None:
        self.channel.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class FakeWorker:
    """A DEALER with a worker identity: heartbeats a ready report, collects the ASSIGNs and PREFETCHes it gets.

    By default it holds what it is assigned for good (never reported running or finished), so the
    scheduler counts each ASSIGN against its slots and pages; with `finishes` it reports each one
    finished in its next report, as a worker that served it at once would, and never fills up."""

    def __init__(self, address: str, worker_id: str = "w1", finishes: bool = False):
        self.ctx = zmq.Context()
        self.worker_id = worker_id
        self.finishes = finishes
        self._unreported: list[str] = []  # assigned since the last report (reported finished, with `finishes`)
        self.sock = make_socket(self.ctx, zmq.DEALER, connect=address, identity=worker_id)
        self.assigned: list[Assign] = []
        self.prefetched: list[Prefetch] = []
        self.malformed = 0  # messages from the scheduler that wire.decode refused
        self.errors: list[str] = []  # what it said about them
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            finished, self._unreported = self._unreported[:MAX_REPORTED_IDS], self._unreported[MAX_REPORTED_IDS:]
            send(self.sock, report(self.worker_id, finished=finished))
            next_report = time.monotonic() + 0.1  # a steady heartbeat, however many messages arrive
            while (wait := next_report - time.monotonic()) > 0 and self.sock.poll(int(wait * 1000) + 1):
                try:
                    message = decode(self.sock.recv_multipart())
                except WireError as e:
                    self.malformed += 1
                    self.errors.append(str(e))
                    continue
                if isinstance(message, Assign):
                    self.assigned.append(message)
                    if self.finishes:
                        self._unreported.append(message.spec.request_id)
                elif isinstance(message, Prefetch):
                    self.prefetched.append(message)

    def wait_assigned(self, request_id: str, timeout_s: float = 5.0) -> Assign:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [a for a in self.assigned if a.spec.request_id == request_id]
            if found:
                return found[0]
            time.sleep(0.05)
        raise TimeoutError(f"{request_id} was not assigned to {self.worker_id}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)
        self.ctx.term()


@contextlib.contextmanager
def scheduler_with_worker(
    worker_timeout: float = 5.0, finishes: bool = False
) -> Iterator[tuple[SchedulerProcess, FakeWorker]]:
    """A serving scheduler process with one registered FakeWorker; both stopped at the end."""
    process = SchedulerProcess(worker_timeout=worker_timeout)
    worker = None
    try:
        process.wait_serving()
        worker = FakeWorker(process.worker_address, finishes=finishes)
        process.wait_worker(worker.worker_id)
        yield process, worker
    finally:
        if worker is not None:
            worker.close()
        process.stop()
