"""The one place ZMQ sockets are made: linger, identity, limits, bind vs connect.

Internal sockets bind to loopback by default (tcp://127.0.0.1:PORT or ipc://); binding to all
interfaces needs an explicit address (docker-compose does that).

Addresses to connect to may come from peers (a request's `reply_to`), so they are checked first
(`loraserve/endpoints.py`), and a socket whose bind or connect fails is closed at once with
linger 0: a half-made socket left open would make `Context.term()` block and wedge shutdown.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

import zmq

from loraserve.endpoints import BadEndpointError, check_endpoint
from loraserve.internal_auth import Curve
from loraserve.wire import Message, encode

__all__ = ["MAX_MESSAGE_BYTES", "BadEndpointError", "PushSockets", "make_socket", "send", "sent_or_raise"]

MAX_MESSAGE_BYTES = 1 << 30  # the largest frame set a socket accepts (an adapter's files)


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    identity: str | None = None,
    linger_ms: int = 0,
    hwm: int = 100_000,
    curve: Curve | None = None,
    rcvhwm: int | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> zmq.Socket:
    """A socket that binds to `bind` or connects to `connect` (exactly one), authenticated with
    `curve` when given (a CURVE server or client: `loraserve/internal_auth.py`). `hwm`: messages queued
    per peer each way (`rcvhwm`: inbound, if different); a peer sending a message over `max_message_bytes`
    is disconnected.

    Raises BadEndpointError for a `connect` address that is not a tcp://, ipc:// or inproc://
    endpoint, zmq.ZMQError when binding or connecting fails; no socket is left open either way.
    """
    if (bind is None) == (connect is None):
        raise ValueError("give exactly one of bind= and connect=")
    if connect is not None:
        check_endpoint(connect, allow_inproc=True)
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm if rcvhwm is None else rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity.encode())
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peers raise instead of silently dropping
        if curve is not None:
            curve.apply(sock)
        if bind is not None:
            sock.bind(bind)
        else:
            sock.connect(connect)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


class PushSockets:
    """PUSH sockets to gateways' token sinks, one per address, made on first use.

    With `curve` (a client of the gateway role) a socket delivers only to a peer holding the
    gateway's secret key. The addresses come from requests, so the set is bounded: past `size` sockets the least
    recently used one is closed (with `linger_ms`, so what it still holds is usually delivered).
    """

    def __init__(self, ctx: zmq.Context, size: int = 64, linger_ms: int = 200, curve: Curve | None = None):
        self.ctx, self.size, self.linger_ms, self.curve = ctx, size, linger_ms, curve
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()

    def get(self, address: str) -> zmq.Socket:
        """The socket for `address`; raises BadEndpointError or zmq.ZMQError when none can be made."""
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._sockets[address] = make_socket(self.ctx, zmq.PUSH, connect=address, curve=self.curve)
            while len(self._sockets) > self.size:
                self._sockets.popitem(last=False)[1].close(linger=self.linger_ms)
        self._sockets.move_to_end(address)
        return sock

    def close(self, linger_ms: int | None = None) -> None:
        for sock in self._sockets.values():
            sock.close(linger=self.linger_ms if linger_ms is None else linger_ms)
        self._sockets.clear()


def send(sock: zmq.Socket, message: Message, *, to: bytes | None = None, flags: int = 0) -> Any:
    """Send a message (to a ROUTER peer when `to` is given) without copying its buffers.

    With flags=zmq.NOBLOCK it raises zmq.Again instead of waiting when the peer is not taking messages.
    On a zmq.asyncio socket, returns the send's Future: an error it met at once (a ROUTER's unknown
    peer) is set on it rather than raised; `sent_or_raise` turns it back into an exception.
    """
    frames = encode(message)
    return sock.send_multipart([to, *frames] if to is not None else frames, flags=flags, copy=False)


def sent_or_raise(result: Any) -> None:
    """Raise the error an asyncio socket's send already failed with (retrieving it, so asyncio does
    not log it as never retrieved); a send still pending or a plain socket's None passes."""
    if isinstance(result, asyncio.Future) and result.done() and result.exception() is not None:
        raise result.exception()
