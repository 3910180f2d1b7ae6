"""The scheduler's intake of worker messages: reports and heartbeats off the workers' ROUTER, in bounded turns.

A worker speaks only for itself: a message is taken only when the worker id it names is its
connection's routing identity, and at most `max_workers` ids register (messages from further ids are
refused before they are decoded, for the cost of a dictionary lookup each). Malformed messages and
messages of other kinds are logged (rate-limited per peer and kind) and dropped; the rest go to the
loop's handlers (`Dispatcher` by type).

A turn reads one message awaited, then those already waiting without an asyncio future each (a shadow
of the socket), until REPORTS_PER_TURN, TURN_BUDGET_S or TURN_BYTES of them: a report's cost, and that
of remaking its worker's view in the round after it, grow with its lists (a round after 2 reports at
every bound costs ~40 ms), so a turn is short and so is the round after it. A turn that ended on its
bounds with more waiting (a flood) is followed by a pause as long as it and the last round took: worker
messages get at most about half of the loop, however many peers flood the socket, and the gRPC side
keeps answering.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Container

import zmq
import zmq.asyncio

from loraserve.dispatch import Dispatcher
from loraserve.log_limit import RateLimitedLog
from loraserve.wire import WireError, decode

log = logging.getLogger(__name__)
REPORTS_PER_TURN = 256
TURN_BUDGET_S = 0.02
TURN_BYTES = 512 << 10
# Per worker connection: messages queued unread at the scheduler (more wait at the sender: a flood costs
# its sender the memory), and the largest message (a report at every bound of `wire.WorkerReport` is 2.7 MiB).
WORKER_QUEUE = 16
MAX_WORKER_MESSAGE_BYTES = 8 << 20


class WorkerInbox:
    """Reads the workers' socket in bounded turns and hands each checked message to `handlers`."""

    def __init__(
        self,
        workers: zmq.asyncio.Socket,
        handlers: Dispatcher,
        registered: Container[str],
        max_workers: Callable[[], int],
        turn_ended: Callable[[], float],
    ):
        """`registered`: the worker ids known now (a live view); `turn_ended()` wakes the loop's round and
        says how long the last round took."""
        self.workers, self.handlers, self.registered = workers, handlers, registered
        self._max_workers, self._turn_ended = max_workers, turn_ended
        self._arrived = zmq.Socket.shadow(workers.underlying)  # what already arrived, read without futures
        self._dropped = RateLimitedLog(log)

    async def run(self) -> None:
        while True:
            frames = await self.workers.recv_multipart()
            started = time.perf_counter()
            size, flooded = self.take(frames), False
            for _ in range(REPORTS_PER_TURN):
                if time.perf_counter() - started >= TURN_BUDGET_S or size >= TURN_BYTES:
                    flooded = True
                    break
                try:
                    frames = self._arrived.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                size += self.take(frames)
            spent = time.perf_counter() - started
            round_s = self._turn_ended()
            await asyncio.sleep(0)  # the round on these messages runs
            if flooded:
                await asyncio.sleep(spent + round_s)

    def take(self, frames: list[bytes]) -> int:
        """Check one message and hand it on; the bytes decoded (0 for one refused before decoding)."""
        identity, body = frames[0], frames[1:]
        if len(self.registered) >= self._max_workers() and identity.decode(errors="replace") not in self.registered:
            self._dropped.warning(
                identity, "registration", "refused: %d workers are registered (--max-workers)", len(self.registered)
            )
            return 0
        try:
            message = decode(body)
        except WireError as e:
            self._dropped.warning(identity, "malformed message", "dropped: %s", e)
            return sum(len(f) for f in body)
        if not self.handlers.handles(message) or message.worker_id.encode() != identity:
            self._dropped.warning(
                identity, type(message).__name__, "dropped: workers send only their own reports and heartbeats"
            )
        else:
            self.handlers(message)
        return sum(len(f) for f in body)
