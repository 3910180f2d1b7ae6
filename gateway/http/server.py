"""uvicorn inside the gateway process, on the gateway's own event loop, beside the gRPC server.

The socket is bound here, before anything runs, so a busy or bad `--http-bind` stops the gateway
with one line naming the flag (uvicorn itself would call `sys.exit` from inside a task). uvicorn
leaves the process's signals alone: SIGTERM drains the whole gateway (`gateway/main.py`), and HTTP
calls get 503 while it drains, as gRPC calls get UNAVAILABLE. `--tls-cert`/`--tls-key` (and
`--tls-client-ca`) serve HTTPS (mutual TLS) with the same files as the gRPC port. Connections
are bounded in number and in how long a client may take to send a request (`connections.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from loraserve.endpoints import listen_port
from loraserve.errors import InvalidConfigError
from loraserve.gateway.admin_service import AdapterAdminService
from loraserve.gateway.chat_template import ChatTemplate
from loraserve.gateway.core import GenerationCore
from loraserve.gateway.http.app import build_app
from loraserve.gateway.http.connections import ConnectionLimits, ensure_descriptors, guarded_protocol
from loraserve.gateway.tool_parsers import ToolCallParser

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, handshake_timeout_s: float):
        super().__init__(config)
        self._handshake_timeout_s = handshake_timeout_s

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the gateway owns SIGTERM/SIGINT (drain) and SIGHUP (key reload)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start-up, but the listeners are made here: uvicorn gives a TLS handshake the
        loop's default of 60 s, and a connection in its handshake holds a descriptor that no limit
        counts yet, so here the handshake must end within the head deadline."""
        await super().startup(sockets=[])
        if self.should_exit or not sockets:
            return

        def protocol() -> asyncio.Protocol:
            return self.config.http_protocol_class(  # as uvicorn's own start-up makes it
                config=self.config, server_state=self.server_state, app_state=self.lifespan.state
            )

        loop = asyncio.get_running_loop()
        for sock in sockets:
            ssl_args = {} if self.config.ssl is None else {"ssl_handshake_timeout": self._handshake_timeout_s}
            server = await loop.create_server(
                protocol, sock=sock, ssl=self.config.ssl, backlog=self.config.backlog, **ssl_args
            )
            self.servers.append(server)


class HttpServer:
    """The OpenAI-compatible API on one listening socket; `run()` serves until cancelled."""

    def __init__(
        self,
        core: GenerationCore,
        admin: AdapterAdminService,
        model_dir: Path,
        bind: str,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        tls_client_ca: Path | None = None,
        limits: ConnectionLimits | None = None,
        tool_parser: ToolCallParser | None = None,
    ):
        limits = limits or ConnectionLimits()
        ensure_descriptors(limits)
        chat_template = ChatTemplate.from_model_dir(model_dir)
        if chat_template is None:
            log.warning("gateway: %s has no chat template: /v1/chat/completions answers 400", model_dir)
        app = build_app(core, admin, chat_template, int(time.time()), tool_parser)
        self.socket = listen(bind)
        self.port = self.socket.getsockname()[1]
        tls: dict = {}
        if tls_cert is not None:
            tls = {"ssl_certfile": str(tls_cert), "ssl_keyfile": str(tls_key)}
            if tls_client_ca is not None:
                tls |= {"ssl_ca_certs": str(tls_client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            ws="none",
            http=guarded_protocol(limits),
            timeout_keep_alive=limits.keep_alive_s,
            **tls,
        )
        self._server = _Server(config, handshake_timeout_s=limits.header_timeout_s)

    async def run(self) -> None:
        """Serve until cancelled; then stop listening and close the connections (briefly: the gateway
        has drained its generations by then)."""
        try:
            await self._server.serve(sockets=[self.socket])
        except asyncio.CancelledError:
            if self._server.started:
                self._server.should_exit = self._server.force_exit = True
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2.0):
                        await self._server.shutdown(sockets=[self.socket])
            raise
        finally:
            self.socket.close()


def listen(bind: str) -> socket.socket:
    """A listening TCP socket on `bind` (`host:port`, `[v6]:port`); InvalidConfigError naming --http-bind."""
    host = bind.rpartition(":")[0].strip("[]")
    try:
        port = listen_port(bind, "--http-bind")
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except (ValueError, OSError) as e:
        raise InvalidConfigError(f"--http-bind {bind!r}: not a usable host:port ({e})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise InvalidConfigError(f"--http-bind {bind}: cannot listen there ({e.strerror or e})") from None
    sock.setblocking(False)
    return sock
