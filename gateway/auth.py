"""Authentication seam: metadata -> principal (tenant), and per-tenant adapter access.

The gateway asks an `Authenticator` on every call. `AllowAll` (the default) admits every caller
as tenant "default" with access to every adapter; API keys mapped to tenants plug in here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Principal:
    tenant: str


class Authenticator(Protocol):
    def authenticate(self, metadata: dict[str, str]) -> Principal:
        """The caller, or raise UnauthenticatedError / PermissionDeniedError."""
        ...

    def may_use_adapter(self, principal: Principal, adapter: str) -> bool: ...

    def may_administer(self, principal: Principal) -> bool: ...


class AllowAll:
    def authenticate(self, metadata: dict[str, str]) -> Principal:
        return Principal("default")

    def may_use_adapter(self, principal: Principal, adapter: str) -> bool:
        return True

    def may_administer(self, principal: Principal) -> bool:
        return True
