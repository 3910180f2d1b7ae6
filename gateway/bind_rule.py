"""The public-bind rule: without an auth file the gateway serves loopback only.

An open gateway (every caller is tenant "default" with every scope: anyone may delete any adapter)
on a reachable address would hand the stack to whoever finds it. So binding anything but loopback
needs `--auth-file`, or `--insecure-no-auth` to say that someone else guards the port.
"""

from __future__ import annotations

from loraserve.endpoints import is_loopback
from loraserve.errors import InvalidConfigError

__all__ = ["check_bind", "is_loopback"]


def check_bind(bind: str, auth_file: object | None, insecure_no_auth: bool) -> None:
    """InvalidConfigError if an open gateway would listen beyond loopback."""
    if auth_file is None and not insecure_no_auth and not is_loopback(bind):
        raise InvalidConfigError(
            f"refusing to serve {bind} without authentication: anyone who reaches it could use and delete "
            "every adapter. Give --auth-file PATH (tenants and API keys, see README 'Tenants and API keys'), "
            "bind 127.0.0.1, or pass --insecure-no-auth if something else guards this port"
        )
