"""Authentication: an API key in the call's metadata -> the tenant it belongs to (a `Principal`).

Clients send `authorization: Bearer <key>`. The key's SHA-256 is compared with every digest of the
auth file with `hmac.compare_digest`, all of them every time, so how long a check takes says
nothing about how close a guessed key came. Without an auth file every caller is tenant "default"
with every scope (the gateway then binds loopback only, see `gateway/bind_rule.py`).

The table is swapped whole on `reload` (SIGHUP): a call sees either the old keys or the new ones.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

from loraserve.errors import PermissionDeniedError, UnauthenticatedError
from loraserve.gateway.tenants import AuthConfig, QuotaLimits, Scope

OPEN_TENANT = "default"
MAX_KEY_CHARS = 512


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: its tenant, what it may do, its quotas."""

    tenant: str
    scopes: frozenset[Scope]
    limits: QuotaLimits = field(default_factory=QuotaLimits)

    @property
    def admin(self) -> bool:
        return Scope.ADMIN in self.scopes

    def require(self, scope: Scope, action: str) -> None:
        """PERMISSION_DENIED unless the caller holds `scope`."""
        if scope not in self.scopes:
            raise PermissionDeniedError(f"tenant {self.tenant!r} may not {action}: it needs the {scope.value!r} scope")


OPEN_PRINCIPAL = Principal(OPEN_TENANT, frozenset(Scope))


class Authenticator:
    """Maps a call's metadata to its `Principal`; `config` None means open access (no auth file)."""

    def __init__(self, config: AuthConfig | None = None):
        self._open = config is None
        self._table: tuple[tuple[bytes, Principal], ...] = ()
        if config is not None:
            self.reload(config)

    @property
    def open(self) -> bool:
        return self._open

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(sorted({p.tenant for _, p in self._table}))

    def reload(self, config: AuthConfig) -> None:
        """Use `config`'s keys from now on (one assignment: calls see the old table or the new one)."""
        self._table = tuple(
            (bytes.fromhex(digest), Principal(t.name, t.scopes, t.limits))
            for t in config.tenants
            for digest in t.api_key_sha256
        )

    def authenticate(self, metadata: dict[str, str]) -> Principal:
        """The caller; UnauthenticatedError when it presents no key or an unknown one."""
        if self._open:
            return OPEN_PRINCIPAL
        key = _bearer_key(metadata.get("authorization", ""))
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for candidate, principal in self._table:  # every digest, no early exit
            if hmac.compare_digest(candidate, digest):
                found = principal
        if found is None or not key:
            raise UnauthenticatedError("a valid API key is required: send the metadata 'authorization: Bearer <key>'")
        return found


def _bearer_key(value: str) -> str:
    """The key of an `authorization` value "Bearer <key>" ("" when it is not one)."""
    scheme, _, key = value.strip().partition(" ")
    if scheme.lower() != "bearer" or len(key) > MAX_KEY_CHARS:
        return ""
    return key.strip()
