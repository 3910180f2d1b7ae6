"""The worker's socket I/O, on a thread of its own: the step loop never receives, decodes, encodes or sends.

`WorkerIO` owns every ZMQ socket the step loop used to touch: the DEALER to the scheduler, the PUSH
sockets to gateways (`PushSockets`) and the monitors that tell when a gateway's connection drops
(`GatewayWatch`). Its thread

- receives and decodes the scheduler's messages (`wire.decode`: a 4k-token ASSIGN costs this thread,
  not a running batch) into `inbox`, and wakes the step loop (`Wakeup`);
- encodes and sends what the step loop queued with `to_scheduler` / `to_gateway`, in order;
- sends the scheduler a `Heartbeat` every `heartbeat_s` (0.25 s) on its own schedule, whatever the step
  loop is doing: the worker's liveness is "its process and this thread answer", not "its last step was
  short". It carries how long the step under way has run (`step_started`, set by the step loop), so a
  slow step is seen as slow (the scheduler places nothing new there) and not as a dead worker; a
  heartbeat that goes out over `LATE_S` late is logged, and if none goes out for `STACKS_AFTER_S`
  faulthandler's watchdog (a C thread) writes every thread's stack to stderr: what held this one up;
- turns what went wrong on the way out into `events` for the step loop (`worker/effects.py`): `Unsendable`
  (a gateway that cannot take its tokens: those requests stop) and `GatewayGone` (a dropped connection).

The step loop hands over Python objects through thread-safe queues and a one-byte inproc nudge; no
socket is used by two threads. Malformed scheduler messages are logged (rate-limited) and dropped here.
"""

from __future__ import annotations

import faulthandler
import logging
import queue
import sys
import threading
import time
from collections.abc import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from loraserve.internal_auth import Curve
from loraserve.log_limit import RateLimitedLog
from loraserve.sockets import BadEndpointError, PushSockets, make_socket, send
from loraserve.wire import MAX_STEP_S, Heartbeat, Message, WireError, decode
from loraserve.worker.effects import GatewayGone, Unsendable
from loraserve.worker.fetch_threads import Wakeup

log = logging.getLogger(__name__)
WATCH_INTERVAL_S = 0.02  # the gateways' connection monitors are read at most this often (and when idle)
MAX_RECEIVED_PER_TURN = 64  # scheduler messages decoded before the outbox is looked at again
LATE_S = 1.0  # a heartbeat this much past its time is logged: this thread did not run (the scheduler may drop us)
STACKS_AFTER_S = 3.0  # no heartbeat for this long: every thread's stack to stderr (faulthandler's C watchdog)


class WorkerIO:
    """The worker's sockets and the thread that drives them (see the module docstring)."""

    def __init__(
        self,
        ctx: zmq.Context,
        scheduler_address: str,
        worker_id: str,
        wakeup: Wakeup,
        scheduler_curve: Curve | None = None,
        gateway_curve: Curve | None = None,
        instance: str = "",
        heartbeat_s: float = 0.25,
        stacks_after_s: float = STACKS_AFTER_S,
    ):
        self.ctx, self._wakeup = ctx, wakeup
        self.worker_id, self.instance, self.heartbeat_s = worker_id, instance, heartbeat_s
        self._stacks_after_s, self._stacks_fd = stacks_after_s, _stderr_fd()
        # monotonic time the step under way started, None between steps: written by the step loop only (one
        # reference swap), read here for the heartbeats
        self.step_started: float | None = None
        self.inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()  # decoded scheduler messages
        self.events: queue.SimpleQueue[Unsendable | GatewayGone] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[tuple[str | None, Message, Sequence[str]]] = queue.SimpleQueue()
        self._dropped = RateLimitedLog(log)
        self._scheduler = make_socket(
            ctx, zmq.DEALER, connect=scheduler_address, identity=worker_id, curve=scheduler_curve
        )
        self._gateways = PushSockets(ctx, curve=gateway_curve)
        self._watch = GatewayWatch()
        self._nudge = Wakeup()  # the step loop wakes the thread when it queues a message
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="worker-io", daemon=True)
        self._thread.start()

    # ---- the step loop's side --------------------------------------------------------------------
    def to_scheduler(self, message: Message) -> None:
        self._queue(None, message, ())

    def to_gateway(self, address: str, message: Message, going_on: Sequence[str] = ()) -> None:
        """Push to a gateway without waiting; if it cannot take it, `going_on` comes back as Unsendable."""
        self._queue(address, message, going_on)

    def _queue(self, address: str | None, message: Message, going_on: Sequence[str]) -> None:
        self._outbox.put((address, message, going_on))
        self._nudge.wake()

    def close(self, linger_ms: int = 200) -> None:
        """Send what is queued, then close every socket (the thread first, so no socket is shared)."""
        self._stopping = True
        self._nudge.wake()
        self._thread.join(10)
        faulthandler.cancel_dump_traceback_later()
        if self._thread.is_alive():  # stuck in a send: leave its sockets to it, lingering nothing
            log.warning("worker I/O thread did not stop in time")
            return
        self._watch.close()
        self._nudge.close()
        self._scheduler.close(linger=linger_ms)
        self._gateways.close(linger_ms=linger_ms)

    # ---- the I/O thread --------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._scheduler, zmq.POLLIN)
        poller.register(self._nudge.fd, zmq.POLLIN)
        watched = heartbeat = time.monotonic()
        try:
            while True:
                ready = dict(poller.poll(int(WATCH_INTERVAL_S * 1000)))
                self._nudge.clear()
                self._send_queued()
                if self._stopping:
                    return
                if (now := time.monotonic()) - heartbeat >= self.heartbeat_s:
                    self._late(now - heartbeat - self.heartbeat_s, now)
                    heartbeat = now
                    self._heartbeat(heartbeat)
                    # Re-armed at each heartbeat: if this thread is held up that long, a C thread (it needs no
                    # interpreter) writes what every thread is doing, the one that holds the interpreter too.
                    if self._stacks_fd is not None:
                        faulthandler.dump_traceback_later(self._stacks_after_s, file=self._stacks_fd)
                if self._scheduler in ready:
                    self._receive()
                if time.monotonic() - watched >= WATCH_INTERVAL_S:  # not on every message: the monitors are slow news
                    watched = time.monotonic()
                    for address in self._watch.disconnected():
                        self._tell(GatewayGone(address))
        except Exception:  # a bug here must not leave the worker running deaf: the step loop sees it die
            log.exception("worker I/O thread failed")
            raise

    def _late(self, late_s: float, now: float) -> None:
        """Log a heartbeat that goes out `late_s` past its time: this thread was held up meanwhile (the process
        was not scheduled, another thread held the interpreter, or a send blocked), and the scheduler may have taken the
        silence for a dead worker."""
        if late_s >= LATE_S:
            started = self.step_started
            self._dropped.warning(
                "scheduler",
                "late heartbeat",
                "sent %.1f s late: the I/O thread was held up (%s)",
                late_s,
                f"the step under way has run {now - started:.1f} s" if started is not None else "no step under way",
            )

    def _heartbeat(self, now: float) -> None:
        started = self.step_started
        step_s = min(max(0.0, now - started), MAX_STEP_S) if started is not None else 0.0
        send(self._scheduler, Heartbeat(self.worker_id, self.instance, step_s))

    def _receive(self) -> None:
        for _ in range(MAX_RECEIVED_PER_TURN):
            try:
                frames = self._scheduler.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                message = decode(frames)
            except WireError as e:
                self._dropped.warning("scheduler", "malformed message", "dropped: %s", e)
                continue
            self.inbox.put(message)
            self._wakeup.wake()

    def _send_queued(self) -> None:
        while True:
            try:
                address, message, going_on = self._outbox.get_nowait()
            except queue.Empty:
                return
            if address is None:
                send(self._scheduler, message)
                continue
            try:
                sock = self._gateways.get(address)
                self._watch.watch(address, sock)
                send(sock, message, flags=zmq.NOBLOCK)
            except (zmq.ZMQError, BadEndpointError) as e:  # gone, stuck or unreachable: stop spending compute on it
                self._dropped.warning(address, "tokens", "not taken (%s); aborting %d requests", e, len(going_on))
                if going_on:
                    self._tell(Unsendable(address, going_on, str(e)))

    def _tell(self, event: Unsendable | GatewayGone) -> None:
        self.events.put(event)
        self._wakeup.wake()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def _stderr_fd() -> int | None:
    """The file descriptor of this process's stderr, None if it has none (a replaced stream without one)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


class GatewayWatch:
    """Which gateways' connections dropped: a ZMQ monitor on each gateway PUSH socket.

    `PushSockets` may close a socket (least recently used) and make a new one for the same address;
    `watch` then moves the monitor to the new socket.
    """

    def __init__(self) -> None:
        self._monitors: dict[str, tuple[zmq.Socket, zmq.Socket]] = {}  # address -> (socket, its monitor)

    def watch(self, address: str, sock: zmq.Socket) -> None:
        known = self._monitors.get(address)
        if known is not None and known[0] is sock:
            return
        if known is not None:
            known[1].close(linger=0)
        for other in [a for a, (watched, _) in self._monitors.items() if watched.closed]:
            self._monitors.pop(other)[1].close(linger=0)
        self._monitors[address] = (sock, sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))

    def disconnected(self) -> list[str]:
        """Addresses whose connection dropped since the last call (never waits)."""
        gone = []
        for address, (sock, monitor) in self._monitors.items():
            while not sock.closed:  # a socket PushSockets closed itself says nothing about its gateway
                try:
                    event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                if event["event"] == zmq.EVENT_DISCONNECTED and address not in gone:
                    gone.append(address)
        return gone

    def close(self) -> None:
        for _, monitor in self._monitors.values():
            monitor.close(linger=0)
        self._monitors.clear()
