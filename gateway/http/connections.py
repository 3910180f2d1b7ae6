"""How many HTTP connections the gateway holds, and how long a client may take to send a request (the
README's HTTP API section states the rules for clients; `ConnectionLimits` holds the flags).

uvicorn alone accepts every connection and waits forever for a request head or body, so idle or
trickling clients with no key could hold sockets until the process runs out of file descriptors.
`guarded_protocol` returns uvicorn's httptools protocol with a connection limit (a new connection takes
the place of one that waits for its client: silent longest, else idle longest; only when every one is
mid-request is it answered 503), a request-head deadline (from accept or the head's first byte, however
trickled; past 16 KiB not yet whole, or without `Host` on HTTP/1.1, 400, as h11 did), a request-body
deadline (either deadline missed: 408, closed), and uvicorn's own keep-alive timeout. No deadline runs
while the gateway answers. Under TLS `server.py` bounds the handshake by the head deadline.

`keep_alive_s` (75 s, as nginx's and Go's) outlasts common client pools' idle expiry (httpx: 5 s, undici:
4 s, aiohttp: 15 s): the pool must drop an idle connection first, or a request sent as the server closes
it is lost on the wire. Idle connections make room for new ones, so the long timeout cannot starve the port.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from typing import ClassVar

from loraserve.config_cli import setting
from loraserve.errors import InvalidConfigError
from loraserve.gateway import metrics

log = logging.getLogger(__name__)

_BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\nretry-after: 1\r\n\r\n"
_TOO_SLOW = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
MAX_HEAD_BYTES = 16 * 1024  # h11's bound on a request head not yet whole


@dataclass(frozen=True)
class ConnectionLimits:
    """The HTTP API's bounds (the module's docstring), each a `--http-*` flag of the gateway."""

    max_connections: int = setting(
        2048, "open HTTP connections at most; one more is answered 503 and closed", flag="--http-max-connections"
    )
    header_timeout_s: float = setting(
        10.0,
        "seconds an HTTP client has to send a whole request head (else 408, closed)",
        flag="--http-header-timeout",
    )  # from connect or from its first byte
    body_timeout_s: float = setting(
        60.0,
        "seconds an HTTP client has to send a whole request body after its head (else 408, closed)",
        flag="--http-body-timeout",
    )
    keep_alive_s: float = setting(
        75.0,
        "seconds an idle HTTP keep-alive connection is kept open (longer than clients' pools keep theirs)",
        flag="--http-keep-alive",
    )

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise InvalidConfigError(f"--http-max-connections must be at least 1, not {self.max_connections}")
        for flag, value in (
            ("--http-header-timeout", self.header_timeout_s),
            ("--http-body-timeout", self.body_timeout_s),
            ("--http-keep-alive", self.keep_alive_s),
        ):
            if not 0 < value < float("inf"):
                raise InvalidConfigError(f"{flag} must be a positive number of seconds, not {value}")


DESCRIPTOR_HEADROOM = 512  # the gateway's other descriptors: gRPC, ZMQ, logs, the model files


def ensure_descriptors(limits: ConnectionLimits) -> None:
    """Raise the process's open-file limit to what `limits.max_connections` needs, if the hard limit
    allows; otherwise say at start that the connection limit cannot protect the gateway."""
    needed = limits.max_connections + DESCRIPTOR_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        soft = raised
    if soft < needed:
        log.warning(
            "gateway: --http-max-connections %d needs %d open files, but the limit is %d: lower "
            "--http-max-connections or raise the limit (ulimit -n)",
            limits.max_connections,
            needed,
            soft,
        )


def guarded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol class with `limits` (pass it as `uvicorn.Config(http=...)`): its parsing
    and its framing of each streamed event are C and a few bytes joins, where h11's were pure Python."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # here: only an HTTP gateway needs it

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _limits = limits
        # Open connections that have not sent a whole request head yet, the longest waiting first, and those
        # idle between requests (response sent, nothing of the next request yet), the longest idle first.
        _silent: ClassVar[dict[GuardedHttpToolsProtocol, None]] = {}  # one per server (this class is made per call)
        _idle: ClassVar[dict[GuardedHttpToolsProtocol, None]] = {}

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._refused = len(self.connections) >= self._limits.max_connections and not self._make_room()
            self._deadline: asyncio.TimerHandle | None = None
            self._owed: str | None = None  # what the client owes now: "head", "body" or nothing
            self._reading: str | None = None  # what the parser's request has still to send: "head", "body", None
            self._head_bytes = 0  # received since the parser's request began, while its head is not whole
            if self._refused:
                metrics.HTTP_CONNECTIONS_REFUSED.labels("full").inc()
                transport.write(_BUSY)
                transport.close()
                return
            super().connection_made(transport)
            self._silent[self] = None
            self._track()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._silent.pop(self, None)
            self._idle.pop(self, None)
            self._set_deadline(None)
            super().connection_lost(exc)

        def _make_room(self) -> bool:
            """Close an open connection that waits for its client, to make room for this one: the one that has
            waited longest for its first request head (answered 503), else the one idle longest between requests
            (closed with no answer, as at its keep-alive timeout). False when every open one is mid-request."""
            for waiting, answer in ((self._silent, _BUSY), (self._idle, b"")):  # an idle one: as its keep-alive timeout
                while waiting:
                    other = next(iter(waiting))
                    del waiting[other]
                    if other.transport.is_closing():
                        continue
                    metrics.HTTP_CONNECTIONS_REFUSED.labels("evicted").inc()
                    other._set_deadline(None)
                    if answer:
                        other.transport.write(answer)
                    other.transport.close()
                    return True
            return False

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if data:  # if it was idle between requests, the next one has begun: its head deadline runs from now
                self._idle.pop(self, None)
            super().data_received(data)
            if self._reading == "head" and not self.transport.is_closing():
                self._head_bytes += len(data)  # the head so far (and what came before it in its first read)
                if self._head_bytes > MAX_HEAD_BYTES:  # as h11 refused it; answered as uvicorn answers a parse error
                    self.send_400_response("Invalid HTTP request received.")
            self._track()

        def on_message_begin(self) -> None:  # the parser's callbacks: a request's first byte, ...
            super().on_message_begin()
            self._reading, self._head_bytes = "head", 0

        def on_headers_complete(self) -> None:  # ... its whole head (no longer silent), ...
            if self.parser.get_http_version() == "1.1" and not any(name == b"host" for name, _ in self.headers):
                raise ValueError("HTTP/1.1 request without Host")  # RFC 9112 3.2: answered 400 by data_received
            super().on_headers_complete()
            self._reading = "body"
            self._silent.pop(self, None)

        def on_message_complete(self) -> None:  # ... its whole body
            super().on_message_complete()
            self._reading = None

        def on_response_complete(self) -> None:
            super().on_response_complete()  # arms uvicorn's keep-alive timer; starts a pipelined request
            if not self.transport.is_closing() and self.cycle.response_complete and self._reading is None:
                self._idle[self] = None  # idle between requests: a response sent, nothing of the next request yet
            self._track()

        def _track(self) -> None:
            """Arm the deadline for what the client owes for the request answered now (not yet for the next)."""
            if self.transport.is_closing() or self.pipeline:  # closing; or an earlier request answered, next ones read
                owed = None
            elif self.cycle is None or (self.cycle.response_complete and self._reading != "body"):
                owed = None if self in self._idle else "head"  # idle: uvicorn's keep-alive timer runs instead
            else:
                owed = "body" if self._reading == "body" else None
            self._set_deadline(owed)

        def _set_deadline(self, owed: str | None) -> None:
            if owed == self._owed:
                return  # a deadline runs from when the debt began, not from the last byte
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            self._owed = owed
            if owed is not None:
                seconds = self._limits.header_timeout_s if owed == "head" else self._limits.body_timeout_s
                self._deadline = self.loop.call_later(seconds, self._too_slow, owed)

        def _too_slow(self, owed: str) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            metrics.HTTP_CONNECTIONS_TIMED_OUT.labels(owed).inc()
            if owed == "head" or not self.cycle.response_started:  # no response begun: say why
                self.transport.write(_TOO_SLOW)
            self.transport.close()

    return GuardedHttpToolsProtocol
