"""The gateway's ZMQ token sink: workers (and the scheduler, for failures) push tokens here.

One PULL socket per gateway; a worker sends one STEP_TOKENS per step for all of this gateway's
requests, and a TOKENS for each request's end (or acknowledgement, or failure). Both are split
into per-request `Tokens` and put on the queue of the RPC that waits for them. Messages for
requests nobody waits for any more (cancelled, or an attempt that was failed over) are dropped,
and so are malformed or unexpected ones (logged rate-limited: a flood must not flood the log).
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from loraserve.dispatch import Dispatcher
from loraserve.internal_auth import InternalKeys
from loraserve.log_limit import RateLimitedLog
from loraserve.sockets import make_socket
from loraserve.wire import StepTokens, Tokens, WireError, decode

log = logging.getLogger(__name__)


class TokenSink:
    """The gateway's PULL socket and the per-request queues its messages are delivered to."""

    def __init__(self, address: str, keys: InternalKeys | None = None):
        self.ctx = zmq.asyncio.Context()
        # With internal keys: a CURVE server that admits workers and the scheduler only.
        self._auth = keys.authenticator(self.ctx) if keys is not None else None
        try:
            self.socket = make_socket(self.ctx, zmq.PULL, bind=address, curve=keys.server() if keys else None)
        except BaseException:
            self._stop_auth()
            raise
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._streams: dict[str, asyncio.Queue[Tokens]] = {}
        self._dropped = RateLimitedLog(log)
        self._dispatch = Dispatcher({Tokens: self._deliver, StepTokens: self._deliver_step})

    def open(self, request_id: str) -> asyncio.Queue[Tokens]:
        stream: asyncio.Queue[Tokens] = asyncio.Queue()
        self._streams[request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def run(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            try:
                message = decode(frames)
            except WireError as e:  # PUSH/PULL carries no peer identity: one window for all senders
                self._dropped.warning("token sink", "malformed message", "dropped: %s", e)
                continue
            if not self._dispatch(message):
                self._dropped.warning("token sink", type(message).__name__, "dropped: not a token message")

    def _deliver(self, message: Tokens) -> None:
        stream = self._streams.get(message.request_id)
        if stream is not None:  # nobody waits for a request that ended or moved to another attempt
            stream.put_nowait(message)

    def _deliver_step(self, message: StepTokens) -> None:
        for tokens in message.split():
            self._deliver(tokens)

    def shutdown(self) -> None:
        self.socket.close(linger=0)
        self._stop_auth()
        self.ctx.term()

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
