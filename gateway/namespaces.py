"""Per-tenant adapter names: what name a caller uses, and which store name it means. Pure functions.

The store holds one flat set of names. A tenant's adapters are kept there as `TENANT~NAME`; a name
without '~' is public (preloaded by the operator, or registered by an admin) and visible to all.
Names in the public API never contain '~' (the same pattern as before tenants), except for admins:

- a tenant without `admin` writes (upload, register, delete) only `TENANT~NAME`, and reads a name
  from its own namespace first, then among the public adapters. It never names another tenant's
  adapter, so looking one up costs exactly what a missing name costs: NOT_FOUND, same message.
- an admin addresses store names as they are: `NAME` is public, `OTHER~NAME` is tenant OTHER's.
  An admin's upload is therefore public unless its name is qualified with a tenant.

`AdapterInfo.name` shows the name the caller uses, and `owner` the owning tenant ("" for public).
"""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.errors import InvalidRequestError
from loraserve.gateway.auth import Principal
from loraserve.names import PUBLIC_NAME, SEPARATOR, STORE_NAME


def owner_of(store_name: str) -> str:
    """The tenant owning a store name ("" for a public adapter)."""
    owner, separator, _ = store_name.partition(SEPARATOR)
    return owner if separator else ""


@dataclass(frozen=True)
class Namespace:
    """One caller's view of the store's names."""

    tenant: str
    admin: bool

    @classmethod
    def of(cls, principal: Principal) -> Namespace:
        return cls(principal.tenant, principal.admin)

    def valid(self, name: str) -> bool:
        """Whether this caller may write `name` in a request."""
        return (STORE_NAME if self.admin else PUBLIC_NAME).fullmatch(name) is not None

    def check(self, name: str, field: str = "name") -> str:
        """`name` if this caller may write it in a request; InvalidRequestError naming `field` otherwise."""
        if not name:
            raise InvalidRequestError(field, "required: the adapter's name")
        if not self.valid(name):
            qualified = " (an admin may prefix a tenant: TENANT~NAME)" if self.admin else ""
            raise InvalidRequestError(
                field,
                f"{name[:140]!r} is not a valid adapter name: 1-128 characters, letters, digits, '.', '_' or '-', "
                f"starting with a letter or digit{qualified}",
            )
        return name

    def candidates(self, name: str) -> tuple[str, ...]:
        """The store names a lookup of `name` tries, in order."""
        if self.admin:
            return (name,)
        return (f"{self.tenant}{SEPARATOR}{name}", name)

    def target(self, name: str) -> str:
        """The store name an upload, registration or delete of `name` writes."""
        return name if self.admin else f"{self.tenant}{SEPARATOR}{name}"

    def shown(self, store_name: str) -> str | None:
        """The name this caller knows `store_name` by, or None if it may not see it."""
        if self.admin:
            return store_name
        owner, separator, name = store_name.partition(SEPARATOR)
        if not separator:
            return store_name
        return name if owner == self.tenant else None
