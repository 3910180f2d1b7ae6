"""The one place ZMQ sockets are made: linger, identity, limits, bind vs connect.

Internal sockets bind to loopback by default (tcp://127.0.0.1:PORT or ipc://); binding to all
interfaces needs an explicit address (docker-compose does that).
"""

from __future__ import annotations

import zmq

from loraserve.wire import Message, encode

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
) -> zmq.Socket:
    """A socket that binds to `bind` or connects to `connect` (exactly one)."""
    if (bind is None) == (connect is None):
        raise ValueError("give exactly one of bind= and connect=")
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peers raise instead of silently dropping
    if bind is not None:
        sock.bind(bind)
    else:
        sock.connect(connect)
    return sock


def send(sock: zmq.Socket, message: Message, *, to: bytes | None = None, flags: int = 0) -> None:
    """Send a message (to a ROUTER peer when `to` is given) without copying its buffers.

    With flags=zmq.NOBLOCK it raises zmq.Again instead of waiting when the peer is not taking messages.
    """
    frames = encode(message)
    sock.send_multipart([to, *frames] if to is not None else frames, flags=flags, copy=False)
