"""What a ZMQ endpoint another process hands us may look like, checked before any socket sees it.

A `reply_to` address arrives from a peer (a gateway's Submit, the scheduler's ASSIGN) and a
worker or the scheduler then connects a socket to it. libzmq accepts or refuses addresses in its
own way — some only after a socket exists, some (a hostname) asynchronously — so the form is
checked here first: `tcp://HOST:PORT` (a hostname, an IPv4 address or a bracketed IPv6 address;
port 1-65535; no wildcard and no `source;dest` pair) or `ipc://PATH` (at most 107 bytes, the
size of a Unix socket path; `@name` for Linux abstract sockets). `inproc://` is allowed only
where the caller says so, since it is meaningless across processes.
"""

from __future__ import annotations

import ipaddress
import re

from loraserve.errors import InvalidConfigError

MAX_ENDPOINT_LEN = 512
MAX_IPC_PATH_BYTES = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux

_HOSTNAME = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
_TCP = re.compile(rf"tcp://(?P<host>{_HOSTNAME}|\[[0-9A-Fa-f:.]{{2,45}}\]):(?P<port>[0-9]{{1,5}})")
_PRINTABLE = re.compile(r"[\x21-\x7e]+")  # no spaces, control characters or non-ASCII in a path


class BadEndpointError(ValueError):
    """An address that is not a ZMQ endpoint this system connects to."""


def check_endpoint(address: object, *, allow_inproc: bool = False) -> str:
    """`address` itself when it is a connectable endpoint; raises BadEndpointError saying why not."""
    if not isinstance(address, str) or not address or len(address) > MAX_ENDPOINT_LEN:
        raise BadEndpointError(f"an endpoint is a non-empty string of at most {MAX_ENDPOINT_LEN} characters")
    scheme, sep, rest = address.partition("://")
    if not sep:
        raise BadEndpointError(f"{address[:64]!r} is not a tcp:// or ipc:// endpoint")
    if scheme == "tcp":
        _check_tcp(address)
    elif scheme == "ipc" or (scheme == "inproc" and allow_inproc):
        _check_path(address, rest, limit=MAX_IPC_PATH_BYTES if scheme == "ipc" else 256)
    else:
        raise BadEndpointError(f"{address[:64]!r}: scheme {scheme[:16]!r} is not tcp or ipc")
    return address


def _check_tcp(address: str) -> None:
    match = _TCP.fullmatch(address)
    if match is None:
        raise BadEndpointError(f"{address[:64]!r} is not of the form tcp://HOST:PORT")
    if not 1 <= int(match["port"]) <= 65535:
        raise BadEndpointError(f"{address[:64]!r}: the port must be in 1-65535")


def _check_path(address: str, path: str, limit: int) -> None:
    if not path or len(path.encode()) > limit or not _PRINTABLE.fullmatch(path):
        raise BadEndpointError(f"{address[:64]!r}: the path must be 1-{limit} printable ASCII bytes")


def listen_port(bind: str, flag: str = "--bind") -> int:
    """The port of a listening address `HOST:PORT` (`[v6]:PORT`; 0: any free one); InvalidConfigError naming
    `flag` unless it is 0-65535 (grpc and getaddrinfo would take 99999 as 34463, modulo 65536, without a word)."""
    port = bind.rpartition(":")[2]
    if not (port.isascii() and port.isdigit() and int(port) <= 65535):
        raise InvalidConfigError(f"{flag} {bind[:64]!r}: the port must be 0-65535 (HOST:PORT)")
    return int(port)


def is_loopback(bind: str) -> bool:
    """Whether a listening address reaches this machine only: a gRPC bind (`host:port`, `[v6]:port`,
    `localhost:port`) or a ZMQ one (`tcp://HOST:PORT`; `ipc://` and `inproc://` are local by nature).
    A host name, `*`, `0.0.0.0` or `[::]` reach beyond it."""
    if bind.startswith(("ipc://", "inproc://")):
        return True
    bind = bind.removeprefix("tcp://")
    host = bind.rsplit(":", 1)[0] if ":" in bind else bind
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
