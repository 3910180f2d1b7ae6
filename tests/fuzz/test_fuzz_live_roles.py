"""Fuzzed internal messages sent to a running worker and to the adapter store's data plane.

Real processes: an adapter store (one preloaded adapter) and a worker connected to a scheduler
socket this test owns (a ZMQ ROUTER speaking the scheduler's side of the protocol). Everything in
`wire_fuzz.any_frames` — valid messages with a field replaced or dropped, random maps under known
and unknown type bytes, raw frames — goes to the worker (as if from its scheduler) and to the
store's data plane (as if from a worker). Afterwards both still answer: the worker runs a real
ASSIGN for the adapter and streams its tokens, the store hands out the adapter's files. The worker
keeps heartbeating throughout, so it was never wedged.

CI runs 150 examples per property; LORASERVE_FUZZ_EXAMPLES raises that for a local run.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import zmq
from hypothesis import given
from stack import free_port_block
from wire_fuzz import FUZZ, any_frames

from loraserve.demo.assets import DEMO_ADAPTERS_DIR, DEMO_MODEL_DIR
from loraserve.params import SamplingParams
from loraserve.request_spec import RequestSpec
from loraserve.sockets import make_socket, send
from loraserve.wire import (
    AdapterPayload,
    Assign,
    FetchAdapter,
    Heartbeat,
    StepTokens,
    Tokens,
    WireError,
    WorkerReport,
    decode,
)

pytestmark = pytest.mark.slow
ADAPTER = "upper"
WORKER_ID = "fuzzed-worker"


class Roles:
    """A store and a worker as child processes; the worker's scheduler is `self.router`."""

    def __init__(self):
        base = free_port_block(3)
        self.store_grpc = f"127.0.0.1:{base}"
        self.store_data = f"tcp://127.0.0.1:{base + 1}"
        self.scheduler_address = f"tcp://127.0.0.1:{base + 2}"
        self.ctx = zmq.Context()
        self.router = make_socket(self.ctx, zmq.ROUTER, bind=self.scheduler_address)
        self.sink = make_socket(self.ctx, zmq.PULL, bind="tcp://127.0.0.1:*")
        self.sink_address = self.sink.getsockopt_string(zmq.LAST_ENDPOINT)
        cli = [sys.executable, "-m", "loraserve.cli", "--log-level", "WARNING"]
        self.store = subprocess.Popen(
            [
                *cli,
                "adapter-store",
                "--model",
                str(DEMO_MODEL_DIR),
                "--bind",
                self.store_grpc,
                "--data-address",
                self.store_data,
                "--preload",
                f"{ADAPTER}={DEMO_ADAPTERS_DIR / ADAPTER}",
            ],
        )
        self.worker = subprocess.Popen(
            [
                *cli,
                "worker",
                "--model",
                str(DEMO_MODEL_DIR),
                "--worker-id",
                WORKER_ID,
                "--device",
                "cpu",
                "--scheduler-address",
                self.scheduler_address,
                "--store-address",
                self.store_data,
                "--pool-pages",
                "256",
                "--torch-threads",
                "1",
            ],
        )
        self.reports = 0

    def alive(self) -> None:
        assert self.store.poll() is None, f"the store exited with {self.store.returncode}"
        assert self.worker.poll() is None, f"the worker exited with {self.worker.returncode}"

    def drain_reports(self, timeout_s: float = 0.0) -> WorkerReport | None:
        """Read what the worker sent; the last report (None if none came within timeout_s). Heartbeats
        (the worker's I/O thread sends them between reports) are checked and passed over."""
        last, deadline = None, time.monotonic() + timeout_s
        while self.router.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            identity, *frames = self.router.recv_multipart()
            message = decode(frames)
            if isinstance(message, Heartbeat):
                assert identity == WORKER_ID.encode() and message.worker_id == WORKER_ID, message
                continue
            assert identity == WORKER_ID.encode() and isinstance(message, WorkerReport), message
            assert message.fatal is None, message.fatal
            last, deadline = message, 0.0  # a report came: read what is already there, wait no more
            self.reports += 1
        return last

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.alive()
            report = self.drain_reports(0.5)
            if report is not None and report.ready:
                return
        raise TimeoutError("the worker did not report ready")

    def to_worker(self, frames: list[bytes]) -> None:
        self.router.send_multipart([WORKER_ID.encode(), *(frames or [b""])])

    def generate(self, request_id: str, max_new_tokens: int = 6, timeout_s: float = 60.0) -> list[int]:
        sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        spec = RequestSpec(
            request_id, [1, 5, 9], sampling, self.sink_address, time.time(), adapter=ADAPTER, adapter_version=1
        )
        assign = Assign(spec)
        send(self.router, assign, to=WORKER_ID.encode())
        tokens: list[int] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.drain_reports()
            if not self.sink.poll(100):
                continue
            message = decode(self.sink.recv_multipart())
            for news in message.split() if isinstance(message, StepTokens) else [message]:
                if not isinstance(news, Tokens) or news.request_id != request_id:
                    continue  # fuzzed ASSIGNs may name this sink too
                assert news.error is None, news.error
                tokens += news.token_ids
                if news.finished:
                    return tokens
        raise TimeoutError(f"{request_id} did not finish")

    def close(self) -> None:
        for process in (self.worker, self.store):
            process.terminate()
        for process in (self.worker, self.store):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        self.router.close(linger=0)
        self.sink.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def roles():
    roles = Roles()
    try:
        roles.wait_ready()
        yield roles
    finally:
        roles.close()


def test_a_running_worker_survives_fuzzed_scheduler_messages(roles):
    before = roles.generate("before-fuzz")
    assert len(before) == 6

    @FUZZ
    @given(any_frames)
    def send_one(frames):
        roles.to_worker(frames)
        roles.drain_reports()

    send_one()
    reports = roles.reports
    assert roles.drain_reports(2.0) is not None, "the worker stopped reporting"
    roles.alive()
    assert roles.generate("after-fuzz") == before, "the same request gives the same tokens after the fuzzing"
    assert roles.reports > reports


def test_the_store_data_plane_survives_fuzzed_worker_messages(roles):
    dealer = make_socket(roles.ctx, zmq.DEALER, connect=roles.store_data)

    @FUZZ
    @given(any_frames)
    def send_one(frames):
        dealer.send_multipart(frames or [b""])

    try:
        send_one()
        send(dealer, FetchAdapter(ADAPTER, 1))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # fuzzed FETCHes got answers (files or failures) first
            assert dealer.poll(int((deadline - time.monotonic()) * 1000)), "the data plane stopped answering"
            try:
                reply = decode(dealer.recv_multipart())
            except WireError as e:
                raise AssertionError("the store sent a malformed message") from e
            if isinstance(reply, AdapterPayload) and reply.name == ADAPTER:
                assert (DEMO_ADAPTERS_DIR / ADAPTER / "adapter_model.safetensors").read_bytes() == reply.weights
                break
        else:
            raise AssertionError("no files for the preloaded adapter")
        roles.alive()
    finally:
        dealer.close(linger=0)
