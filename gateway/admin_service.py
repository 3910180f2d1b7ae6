"""Adapter admin, the gRPC RPCs `ListAdapters`, `DescribeAdapter`, `UploadAdapter`,
`RegisterAdapterFromPath` and `DeleteAdapter`: relayed to the adapter store, in the caller's namespace.

Listing and describing need the scope `generate`; writes need `adapters`, and each leaves a line in
the audit log (`gateway/audit.py`). A write's new version is taken into the adapter versions at once
(the store's Watch confirms it). The HTTP edge's adapter routes call `register` and `delete`.
"""

from __future__ import annotations

import math

import grpc

from loraserve.errors import LoraserveError
from loraserve.gateway.adapter_versions import AdapterVersions
from loraserve.gateway.audit import AuditRecord, audited
from loraserve.gateway.gate import Gate
from loraserve.gateway.grpc_calls import metadata_of
from loraserve.gateway.namespaces import Namespace
from loraserve.gateway.store_client import StoreClient
from loraserve.gateway.tenant_adapters import TenantAdapters, renamed_uploads, shown
from loraserve.gateway.tenants import Scope
from loraserve.grpc_streams import refuse_stream
from loraserve.grpc_utils import internal_call
from loraserve.v1 import common_pb2, gateway_pb2


class AdapterAdminService:
    """The adapter RPCs of `loraserve.v1.LoraServe`."""

    def __init__(
        self,
        gate: Gate,
        store: StoreClient,
        adapters: TenantAdapters,
        versions: AdapterVersions,
        upload_timeout_s: float,
    ):
        self.gate, self.store, self.adapters, self.versions = gate, store, adapters, versions
        self.upload_timeout_s = upload_timeout_s

    async def ListAdapters(self, request: gateway_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext):
        principal = self.gate.authenticate(metadata_of(context))
        principal.require(Scope.GENERATE, "list adapters")
        return await self.adapters.list(Namespace.of(principal))

    async def DescribeAdapter(self, request: gateway_pb2.DescribeAdapterRequest, context: grpc.aio.ServicerContext):
        principal = self.gate.authenticate(metadata_of(context))
        principal.require(Scope.GENERATE, "describe adapters")
        ns = Namespace.of(principal)
        return await self.adapters.describe(ns, ns.check(request.name))

    async def UploadAdapter(self, request_iterator, context: grpc.aio.ServicerContext):
        with audited("upload") as record:
            try:
                ns = self._namespace(metadata_of(context), record, "upload adapters")
            except LoraserveError:
                await refuse_stream(request_iterator, context)  # the client may still be sending
                raise
            remaining = context.time_remaining()
            timeout = min(self.upload_timeout_s, remaining if remaining is not None else math.inf)
            targets: list[str] = []
            renamed = renamed_uploads(ns, request_iterator, targets)
            try:
                info = await internal_call("the adapter store", lambda: self.store.relay_upload(renamed, timeout))
            except LoraserveError:
                record.adapter = targets[0] if targets else "-"
                await refuse_stream(request_iterator, context)
                raise
            record.adapter, record.version = info.name, info.version
            self.versions.learned(info)
            return shown(ns, info)

    async def RegisterAdapterFromPath(self, request, context: grpc.aio.ServicerContext):
        return await self.register(metadata_of(context), request)

    async def DeleteAdapter(self, request: gateway_pb2.DeleteAdapterRequest, context: grpc.aio.ServicerContext):
        return await self.delete(metadata_of(context), request.name)

    async def register(
        self, metadata: dict[str, str], request: gateway_pb2.RegisterAdapterFromPathRequest
    ) -> common_pb2.AdapterInfo:
        """Register an adapter from a path under the store's adapter root, for the caller of `metadata`."""
        with audited("register") as record:
            ns = self._namespace(metadata, record, "register adapters", request.name)
            target = gateway_pb2.RegisterAdapterFromPathRequest()
            target.CopyFrom(request)
            target.name = record.adapter = ns.target(ns.check(request.name))
            info = await self.store.ask("RegisterFromPath", target)
            record.version = info.version
            self.versions.learned(info)
            return shown(ns, info)

    async def delete(self, metadata: dict[str, str], name: str) -> gateway_pb2.DeleteAdapterResponse:
        """Delete the adapter `name` of the caller of `metadata`."""
        with audited("delete") as record:
            ns = self._namespace(metadata, record, "delete adapters", name)
            record.adapter = ns.target(ns.check(name))
            deleted = await self.adapters.delete(ns, name)
            record.version = deleted.version
            self.versions.forget(record.adapter)
            return deleted

    def _namespace(self, metadata: dict[str, str], record: AuditRecord, action: str, name: str = "") -> Namespace:
        """The caller's namespace, if it holds the `adapters` scope; who asked, for what, goes in the audit record."""
        principal = self.gate.authenticate(metadata)
        ns = Namespace.of(principal)
        record.tenant = principal.tenant
        if ns.valid(name):
            record.adapter = ns.target(name)
        principal.require(Scope.ADAPTERS, action)
        return ns
