"""Disconnects on the workers' socket, read on a thread of their own.

ZMQ's I/O thread writes every socket-monitor event into a queue and blocks when it cannot, and
with it every connection of the monitored socket. A burst of plain TCP connect+close cycles (a
port scan, a TCP liveness probe, a flapping network) makes one event each; read at the pace of
the asyncio loop, they backed up and stalled the workers' socket for minutes. Here a thread does
nothing but read them from an unbounded inproc queue, and wakes the loop at most once per burst:
`on_disconnect` runs on the loop, and not again until the loop has taken the previous wake-up.

`WorkerProbes` turns those disconnects into probes of every worker (a send that ROUTER_MANDATORY refuses
for a peer that is gone), coalesced: at most one probe round per `PROBE_INTERVAL_S`.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterable

import zmq

from loraserve.scheduler import metrics

POLL_MS = 100  # how soon the thread notices `stop`
PROBE_INTERVAL_S = 0.5  # at most one probe of every worker per this, however many disconnects


class DisconnectWatch:
    """Calls `on_disconnect(n)` on the asyncio loop after disconnects on `sock`, coalesced: `n` is
    how many arrived since the previous call."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket):
        address = f"inproc://disconnects.{uuid.uuid4().hex}"
        sock.monitor(address, zmq.EVENT_DISCONNECTED)
        self._sock = sock
        self._events = zmq.Context.shadow(ctx.underlying).socket(zmq.PAIR)
        self._events.rcvhwm = 0  # an inproc pipe is unbounded when either end's limit is 0
        self._events.connect(address)
        self._stop = threading.Event()
        self._started = False
        self._finished = threading.Event()  # the thread has closed its socket
        self._lock = threading.Lock()
        self._unreported = 0  # disconnects not yet passed to `on_disconnect`

    async def run(self, on_disconnect: Callable[[int], None]) -> None:
        """Read events on a thread until cancelled or `close`d."""
        loop = asyncio.get_running_loop()
        self._started = True

        def wake() -> None:
            with self._lock:
                count, self._unreported = self._unreported, 0
            on_disconnect(count)

        def read() -> None:
            try:
                while not self._stop.is_set():
                    if not self._events.poll(POLL_MS):
                        continue
                    count = 0
                    while self._events.poll(0):
                        self._events.recv_multipart()
                        count += 1
                    with self._lock:
                        first = self._unreported == 0
                        self._unreported += count
                    if first:  # otherwise a wake-up is still waiting for the loop
                        loop.call_soon_threadsafe(wake)
            finally:
                self._events.close(linger=0)
                self._finished.set()

        try:
            await asyncio.to_thread(read)
        finally:
            self._stop.set()

    def close(self) -> None:
        """Stop monitoring; call from the thread that owns `sock`, before its context terminates."""
        self._stop.set()
        self._sock.disable_monitor()
        if self._started:
            self._finished.wait(2 * POLL_MS / 1000)
        else:
            self._events.close(linger=0)


class WorkerProbes:
    """After disconnects on the workers' socket (`disconnected`, from a `DisconnectWatch`), `probe` every
    worker: ROUTER_MANDATORY refuses a send to a peer that is gone. However many disconnects arrive, at most
    one probe round runs per `PROBE_INTERVAL_S`, so the cost of churn is bounded by the number of workers."""

    def __init__(self, workers: Callable[[], Iterable[str]], probe: Callable[[str], object]):
        self._workers, self._probe = workers, probe
        self._disconnected = asyncio.Event()

    def disconnected(self, count: int) -> None:
        metrics.WORKER_DISCONNECTS.inc(count)
        self._disconnected.set()

    async def run(self) -> None:
        while True:
            await self._disconnected.wait()
            self._disconnected.clear()
            for delay in (0.0, 0.1):  # the ROUTER may forget the peer a moment after the event
                await asyncio.sleep(delay)
                for worker_id in list(self._workers()):
                    self._probe(worker_id)
            await asyncio.sleep(PROBE_INTERVAL_S)
