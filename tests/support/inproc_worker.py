"""A real worker service in the test process: its engine emulated, its scheduler and gateway plain sockets.

`InprocWorker` runs `WorkerService.run` (an emulated engine on the demo model, `emulated.py`) on a thread
of its own; the test plays the scheduler on a ROUTER the worker connects to (ASSIGNs out, reports and
heartbeats in) and the gateway on a PULL socket the worker pushes tokens to. Every socket of the test's
side is used by the test's thread only: `pump` reads both, recording each message with its arrival time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from emulated import emulated_engine

from loraserve.params import SamplingParams
from loraserve.request_spec import RequestSpec
from loraserve.sockets import make_socket, send
from loraserve.wire import Assign, Message, StepTokens, Tokens, WorkerReport, decode
from loraserve.worker.config import FetchConfig, WorkerConfig
from loraserve.worker.service import WorkerService


@dataclass
class Stream:
    """What the gateway side received for one request: its tokens with their arrival times, and its end."""

    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # monotonic arrival of each message that brought tokens
    end: Tokens | None = None


class InprocWorker:
    """A WorkerService on a thread, between a ROUTER (the scheduler) and a PULL socket (the gateway)."""

    def __init__(self, profile: Path, worker_id: str = "w0", **engine_config):
        self.worker_id = worker_id
        self.ctx = zmq.Context()
        self.scheduler = make_socket(self.ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
        self.gateway = make_socket(self.ctx, zmq.PULL, bind="tcp://127.0.0.1:*")
        self.reply_to = self.gateway.getsockopt_string(zmq.LAST_ENDPOINT)
        config = WorkerConfig(
            worker_id,
            scheduler_address=self.scheduler.getsockopt_string(zmq.LAST_ENDPOINT),
            fetch=FetchConfig(
                store_address="tcp://127.0.0.1:9"
            ),  # never fetched from: the engine holds the demo adapters
        )
        self.service = WorkerService(emulated_engine(profile, **engine_config), config)
        self.from_worker: list[tuple[float, Message]] = []  # reports and heartbeats, with arrival times
        self.streams: dict[str, Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.service.run, args=(self._stop,), daemon=True)
        self._thread.start()

    def heartbeats(self) -> list[tuple[float, Message]]:
        """The worker's heartbeats (by name: a checkout without them still runs the other tests)."""
        return [(t, m) for t, m in self.from_worker if type(m).__name__ == "Heartbeat"]

    def reports(self) -> list[tuple[float, WorkerReport]]:
        return [(t, m) for t, m in self.from_worker if isinstance(m, WorkerReport)]

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        self.pump_until(lambda: any(r.ready for _, r in self.reports()), timeout_s, "the worker never reported ready")

    def assign(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> None:
        spec = RequestSpec(request_id, prompt_ids, sampling, self.reply_to, time.time())
        self.streams[request_id] = Stream()
        send(self.scheduler, Assign(spec), to=self.worker_id.encode())

    def pump(self, seconds: float) -> None:
        """Receive from the worker for `seconds`."""
        deadline = time.monotonic() + seconds
        poller = zmq.Poller()
        poller.register(self.scheduler, zmq.POLLIN)
        poller.register(self.gateway, zmq.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(max(1, int(left * 1000))))
            now = time.monotonic()
            if self.scheduler in ready:
                frames = self.scheduler.recv_multipart()
                self.from_worker.append((now, decode(frames[1:])))
            if self.gateway in ready:
                message = decode(self.gateway.recv_multipart())
                for tokens in message.split() if isinstance(message, StepTokens) else [message]:
                    self._received(tokens, now)

    def pump_until(self, done, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, what
            assert self._thread.is_alive(), "the worker's step loop died"
            self.pump(0.05)

    def wait_ended(self, *request_ids: str, timeout_s: float = 60.0) -> None:
        self.pump_until(
            lambda: all(self.streams[r].end is not None for r in request_ids), timeout_s, f"{request_ids} never ended"
        )

    def _received(self, tokens: Tokens, now: float) -> None:
        stream = self.streams.get(tokens.request_id)
        if stream is None:
            return
        if tokens.token_ids:
            stream.tokens += tokens.token_ids
            stream.times.append(now)
        if tokens.finished:
            stream.end = tokens

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.scheduler.close(linger=0)
        self.gateway.close(linger=0)
        self.ctx.term()
