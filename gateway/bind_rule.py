"""The public-bind rule: without an auth file the gateway serves loopback only.

An open gateway (every caller is tenant "default" with every scope: anyone may delete any adapter)
on a reachable address would hand the stack to whoever finds it. So binding anything but loopback
needs `--auth-file`, or `--insecure-no-auth` to say that someone else guards the port.
"""

from __future__ import annotations

import ipaddress

from loraserve.errors import InvalidConfigError


def is_loopback(bind: str) -> bool:
    """Whether a gRPC bind address (`host:port`, `[v6]:port`, `localhost:port`) is loopback only."""
    host = bind.rsplit(":", 1)[0] if ":" in bind else bind
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, "", "0.0.0.0" or "[::]" all reach beyond this machine


def check_bind(bind: str, auth_file: object | None, insecure_no_auth: bool) -> None:
    """InvalidConfigError if an open gateway would listen beyond loopback."""
    if auth_file is None and not insecure_no_auth and not is_loopback(bind):
        raise InvalidConfigError(
            f"refusing to serve {bind} without authentication: anyone who reaches it could use and delete "
            "every adapter. Give --auth-file PATH (tenants and API keys, see README 'Tenants and API keys'), "
            "bind 127.0.0.1, or pass --insecure-no-auth if something else guards this port"
        )
