"""Who may call the gateway: every call, on either edge, is authenticated here, and refused
UNAVAILABLE once the gateway drains (SIGTERM: `drain()`); the calls in flight go on."""

from __future__ import annotations

from loraserve.errors import UnavailableError
from loraserve.gateway.auth import Authenticator, Principal


class Gate:
    """The API keys (`Authenticator`) and whether the gateway is draining."""

    def __init__(self, auth: Authenticator):
        self.auth = auth
        self.draining = False

    @property
    def open(self) -> bool:
        """No auth file: every caller is tenant "default"."""
        return self.auth.open

    def drain(self) -> None:
        """From now on refuse every call with UNAVAILABLE."""
        self.draining = True

    def authenticate(self, metadata: dict[str, str]) -> Principal:
        """The caller of a call with `metadata` (lower-case keys); UNAVAILABLE for everyone while draining."""
        if self.draining:
            raise UnavailableError("this gateway is shutting down; retry on another one")
        return self.auth.authenticate(metadata)
