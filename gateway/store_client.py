"""The gateway's calls to the adapter store: one call with the internal timeout and the request's
trace (`ask`), and an upload relayed as a stream (`relay_upload`)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from loraserve import telemetry
from loraserve.errors import UnavailableError
from loraserve.grpc_streams import forward_stream
from loraserve.grpc_utils import internal_call
from loraserve.v1 import adapter_store_pb2_grpc, common_pb2, gateway_pb2
from loraserve.v1.adapter_store_pb2 import GetStoreStateRequest

log = logging.getLogger(__name__)
# statuses of a store call that may say its connection broke rather than give the store's answer
_MAYBE_TRANSPORT = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)


class StoreClient:
    """The AdapterStore stub, with the gateway's timeout; failures come back as LoraserveErrors."""

    def __init__(self, stub: adapter_store_pb2_grpc.AdapterStoreStub, timeout_s: float):
        self.stub, self.timeout_s = stub, timeout_s

    async def ask(self, method: str, request: Any) -> Any:
        """The store's answer to `method(request)`."""
        call = getattr(self.stub, method)
        return await internal_call(
            "the adapter store",
            lambda: call(request, timeout=self.timeout_s, metadata=telemetry.grpc_metadata()),
        )

    async def relay_upload(
        self, requests: AsyncIterator[gateway_pb2.UploadAdapterRequest], timeout: float
    ) -> common_pb2.AdapterInfo:
        """The store's Upload fed with `requests`. A transport failure of that call (the store died or
        its connection broke mid-upload) ends UNAVAILABLE, saying the upload may be retried: any
        UNAVAILABLE, and any INTERNAL, UNKNOWN or CANCELLED while the store does not answer (grpc.aio
        reports a write to a connection that just broke as INTERNAL, hiding why)."""
        try:
            return await forward_stream(self.stub.Upload, requests, timeout, telemetry.grpc_metadata())
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                why = e.details() or "unreachable"
            elif e.code() in _MAYBE_TRANSPORT and not await self._answers():
                why = "its connection broke during the upload"
            else:
                raise
            log.warning("upload relay: the adapter store went away (%s: %s)", e.code().name, e.details())
            raise UnavailableError(
                f"the adapter store is unavailable ({why}): the upload did not complete and may be retried"
            ) from None

    async def _answers(self) -> bool:
        """Does the adapter store answer a call at all (any status but UNAVAILABLE or a timeout)?"""
        try:
            await self.stub.GetStoreState(GetStoreStateRequest(), timeout=1.0, metadata=telemetry.grpc_metadata())
        except grpc.aio.AioRpcError as e:
            return e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        return True
