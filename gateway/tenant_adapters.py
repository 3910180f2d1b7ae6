"""The adapter store as one tenant sees it (`gateway/namespaces.py` says how names map).

Lookups try the caller's namespace, then the public names; they never ask about a name the caller
could not see, so another tenant's adapter costs what a missing one costs, and fails the same way:
`AdapterNotFoundError(name)`, with no list of known names. Writes go to the caller's namespace.
Answers show each adapter by the name the caller uses, with its `owner`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from loraserve.errors import AdapterNotFoundError, NotFoundError, PermissionDeniedError
from loraserve.gateway.adapter_versions import AdapterVersion, AdapterVersions
from loraserve.gateway.namespaces import Namespace, owner_of
from loraserve.v1 import common_pb2, gateway_pb2

StoreCall = Callable[[str, Any], Awaitable[Any]]  # (AdapterStore method name, request) -> response


class TenantAdapters:
    """Name resolution, listing and the store-name side of adapter admin, for any caller."""

    def __init__(self, ask: StoreCall, versions: AdapterVersions):
        self._ask, self._versions = ask, versions

    async def resolve(self, ns: Namespace, name: str) -> tuple[str, AdapterVersion]:
        """(store name, current version) a generation with adapter `name` uses; the cache first."""
        candidates = ns.candidates(name)
        for candidate in candidates:
            cached = self._versions.get(candidate)
            if cached is not None:
                return candidate, cached
        info = await self._find(candidates, name)
        return info.name, AdapterVersion(info.version, info.sha256, info.rank)

    async def describe(self, ns: Namespace, name: str) -> common_pb2.AdapterInfo:
        return shown(ns, await self._find(ns.candidates(name), name))

    async def list(self, ns: Namespace) -> gateway_pb2.ListAdaptersResponse:
        """What the caller can use, by the names it uses (its own adapter hides a public one of its name)."""
        response = await self._ask("List", gateway_pb2.ListAdaptersRequest())
        visible: dict[str, common_pb2.AdapterInfo] = {}
        for info in response.adapters:
            name = ns.shown(info.name)
            if name is not None and (name not in visible or owner_of(info.name)):
                visible[name] = shown(ns, info)
        return gateway_pb2.ListAdaptersResponse(adapters=[visible[n] for n in sorted(visible)])

    async def delete(self, ns: Namespace, name: str) -> gateway_pb2.DeleteAdapterResponse:
        """Delete the caller's adapter `name` (an admin: the store name `name`)."""
        try:
            return await self._ask("Delete", gateway_pb2.DeleteAdapterRequest(name=ns.target(name)))
        except NotFoundError:
            if not ns.admin and await self._exists(name):
                raise PermissionDeniedError(
                    f"adapter {name!r} is public: only an admin may delete it (tenant {ns.tenant!r})"
                ) from None
            raise AdapterNotFoundError(name) from None

    async def _find(self, candidates: tuple[str, ...], name: str) -> common_pb2.AdapterInfo:
        for candidate in candidates:
            try:
                return await self._ask("Describe", gateway_pb2.DescribeAdapterRequest(name=candidate))
            except NotFoundError:
                continue
        raise AdapterNotFoundError(name)

    async def _exists(self, store_name: str) -> bool:
        try:
            await self._ask("Describe", gateway_pb2.DescribeAdapterRequest(name=store_name))
        except NotFoundError:
            return False
        return True


def shown(ns: Namespace, info: common_pb2.AdapterInfo) -> common_pb2.AdapterInfo:
    """`info` (from the store) as the caller sees it: its name for it, and the owner."""
    out = common_pb2.AdapterInfo()
    out.CopyFrom(info)
    out.name = ns.shown(info.name) or info.name
    out.owner = owner_of(info.name)
    return out


async def renamed_uploads(
    ns: Namespace, requests: AsyncIterator[gateway_pb2.UploadAdapterRequest], targets: list[str]
) -> AsyncIterator[gateway_pb2.UploadAdapterRequest]:
    """The client's upload stream with each header's name checked and mapped to its store name
    (appended to `targets`); chunks pass through untouched."""
    async for request in requests:
        if request.WhichOneof("part") == "header":
            header = gateway_pb2.UploadHeader()
            header.CopyFrom(request.header)
            header.name = ns.target(ns.check(request.header.name, "header.name"))
            targets.append(header.name)
            yield gateway_pb2.UploadAdapterRequest(header=header)
        else:
            yield request
