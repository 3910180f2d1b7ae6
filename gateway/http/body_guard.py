"""What the HTTP port refuses before it reads a request body: a caller without a valid key, a body too big.

`BodyGuard` is plain ASGI middleware in front of the routes: from the headers alone it answers 401 (503
while the gateway drains) and 413 when Content-Length is over the cap; then it reads the body itself,
counting bytes as they arrive, and answers 413 as soon as the count passes the cap. A body within the
cap reaches the routes as one message. A refusal closes the connection: the rest is never read.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from loraserve.errors import LoraserveError
from loraserve.gateway.http.errors import HttpError, error_body, http_error

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]
Authenticate = Callable[[dict[str, str]], object]  # raises LoraserveError (UNAUTHENTICATED, UNAVAILABLE)


class BodyGuard:
    """ASGI middleware: authenticate from the headers, then read at most `max_body_bytes` of body."""

    def __init__(
        self, app: ASGIApp, authenticate: Authenticate, max_body_bytes: int, open_paths: frozenset[str] = frozenset()
    ):
        self.app, self.authenticate, self.max_body_bytes = app, authenticate, max_body_bytes
        self.open_paths = open_paths  # answered without a key (probes): only the body cap applies

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        refusal = self._refusal(headers, scope["path"] in self.open_paths)
        if refusal is not None:
            await _refuse(send, refusal)
            return
        try:
            body = await self._read_body(receive)
        except _ClientGone:
            return  # the client left mid-body: nobody to answer
        if body is None:
            await _refuse(send, self._too_large())
            return
        await self.app(scope, _replay(body, receive), send)

    def _refusal(self, headers: dict[str, str], open_path: bool) -> HttpError | None:
        """The answer the headers alone earn (401, 503, 413), or None."""
        try:
            if not open_path:
                self.authenticate(headers)
        except LoraserveError as e:
            return http_error(e)
        length = headers.get("content-length", "").strip()
        if length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        return None

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body; None as soon as it passes the cap; _ClientGone if the client disconnects."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            if len(body) + len(chunk) > self.max_body_bytes:
                return None
            body += chunk
            if not message.get("more_body", False):
                return bytes(body)

    def _too_large(self) -> HttpError:
        message = f"the request body is over {self.max_body_bytes} bytes (this gateway's cap): send a shorter prompt"
        return HttpError(413, error_body(message, "invalid_request_error"))


class _ClientGone(Exception):
    """The client disconnected before its body was whole."""


async def _refuse(send: Send, error: HttpError) -> None:
    """Send `error` and ask the server to close the connection once it is sent."""
    body = json.dumps(error.body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in error.headers.items()]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives `body` as one message, then whatever the connection gives (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
