"""The AdapterStore gRPC servicer: the control plane, and the only place protobuf meets the store.

Handlers raise `loraserve.errors` exceptions; the server's ErrorInterceptor turns them into
statuses. Until the store's catalogue is loaded every RPC is refused UNAVAILABLE (`check_loaded`).
Validation, file reading and durable writes are CPU / disk work, so they run in a thread
(`asyncio.to_thread`) and the event loop keeps answering while a large adapter is checked or kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace

from loraserve import telemetry
from loraserve.adapter_store.store import AdapterStore
from loraserve.adapter_store.upload import UploadAssembler
from loraserve.adapter_store.validation import AdapterRecord, check_name
from loraserve.adapter_store.versions import StoreStats
from loraserve.errors import InvalidRequestError, LoraserveError
from loraserve.grpc_streams import refuse_stream
from loraserve.v1 import adapter_store_pb2, adapter_store_pb2_grpc, common_pb2, gateway_pb2


def record_to_pb(record: AdapterRecord) -> common_pb2.AdapterInfo:
    return common_pb2.AdapterInfo(
        name=record.name,
        version=record.version,
        rank=record.rank,
        lora_alpha=record.lora_alpha,
        scale=record.scale,
        target_modules=list(record.target_modules),
        layers=list(record.layers),
        size_bytes=record.size_bytes,
        created_unix=record.created_unix,
        source=record.source,
        sha256=record.sha256,
    )


def stats_to_pb(stats: StoreStats, data_address: str) -> adapter_store_pb2.StoreState:
    return adapter_store_pb2.StoreState(
        adapters=stats.adapters,
        used_bytes=stats.used_bytes,
        budget_bytes=stats.budget_bytes,
        max_adapter_bytes=stats.max_adapter_bytes,
        data_address=data_address,
        retired_versions=stats.retired_versions,
        retired_bytes=stats.retired_bytes,
    )


class AdapterStoreService(adapter_store_pb2_grpc.AdapterStoreServicer):
    """The store's gRPC control plane over an `AdapterStore`: register, list, describe, delete, watch."""

    def __init__(self, store: AdapterStore, data_address: str):
        self.store, self.data_address = store, data_address

    async def Upload(self, request_iterator, context):
        upload = UploadAssembler(self.store.limits.max_adapter_bytes)
        try:
            self.store.check_loaded()
            async for request in request_iterator:
                self._take(upload, request)
        except LoraserveError:
            await refuse_stream(request_iterator, context)  # refused mid-stream: let the client stop first
            raise
        files = upload.finish()
        with _span("adapter_store.register", context, files.name) as span:
            record = await asyncio.to_thread(
                self.store.register, files.name, files.config_json, files.weights, files.weights_format, "upload"
            )
            span.set_attribute("loraserve.adapter.version", record.version)
        return record_to_pb(record)

    def _take(self, upload: UploadAssembler, request: gateway_pb2.UploadAdapterRequest) -> None:
        part = request.WhichOneof("part")
        if part == "header":
            upload.header(request.header.name)
        elif part == "chunk":
            upload.chunk(request.chunk.file, request.chunk.data)
            self.store.check_fits(upload.weights_bytes)  # refuse over-budget uploads mid-stream
        else:
            raise InvalidRequestError("part", "an upload message must carry a header or a chunk")

    async def RegisterFromPath(self, request: gateway_pb2.RegisterAdapterFromPathRequest, context):
        self.store.check_loaded()
        check_name(request.name)
        with _span("adapter_store.register", context, request.name) as span:
            span.set_attribute("loraserve.adapter.path", request.path)
            record = await asyncio.to_thread(self.store.register_from_path, request.name, request.path)
            span.set_attribute("loraserve.adapter.version", record.version)
        return record_to_pb(record)

    async def List(self, request: gateway_pb2.ListAdaptersRequest, context):
        self.store.check_loaded()
        return gateway_pb2.ListAdaptersResponse(adapters=[record_to_pb(r) for r in self.store.list()])

    async def Describe(self, request: gateway_pb2.DescribeAdapterRequest, context):
        self.store.check_loaded()
        check_name(request.name)
        return record_to_pb(self.store.describe(request.name))

    async def Delete(self, request: gateway_pb2.DeleteAdapterRequest, context):
        self.store.check_loaded()
        check_name(request.name)
        version = await asyncio.to_thread(self.store.delete, request.name)  # a durable write: off the event loop
        return gateway_pb2.DeleteAdapterResponse(version=version)

    async def GetStoreState(self, request: adapter_store_pb2.GetStoreStateRequest, context):
        self.store.check_loaded()
        return stats_to_pb(self.store.stats(), self.data_address)

    async def Watch(self, request: adapter_store_pb2.WatchAdaptersRequest, context):
        """Every current version, `synced`, then every change: each wake-up sends what differs from
        what this watcher was last told (so a burst of changes costs one pass, and none is missed)."""
        self.store.check_loaded()
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        unsubscribe = self.store.subscribe(lambda: loop.call_soon_threadsafe(changed.set))
        told: dict[str, tuple[int, str, int]] = {}
        try:
            synced = False
            while True:
                changed.clear()
                current = {r.name: (r.version, r.sha256, r.rank) for r in self.store.list()}
                for name, (version, sha256, rank) in current.items():
                    if told.get(name) != (version, sha256, rank):
                        yield adapter_store_pb2.AdapterChange(name=name, version=version, sha256=sha256, rank=rank)
                for name in told.keys() - current.keys():
                    yield adapter_store_pb2.AdapterChange(name=name, deleted=True)
                told = current
                if not synced:
                    synced = True
                    yield adapter_store_pb2.AdapterChange(synced=True)
                await changed.wait()
        finally:
            unsubscribe()


@contextmanager
def _span(name: str, context, adapter: str) -> Iterator[trace.Span]:
    """A span under the caller's trace context (gRPC metadata), naming the adapter."""
    parent = telemetry.context_from(context.invocation_metadata())
    with telemetry.tracer().start_as_current_span(name, context=parent) as span:
        span.set_attribute("loraserve.adapter.name", adapter)
        yield span
