"""An internal port refuses a tokenless upload cleanly: a client streaming large chunks without the
internal token gets UNAUTHENTICATED (not INTERNAL "Internal error from Core" from a write racing the
abort), and the server logs no error. A real grpc.aio server with the token interceptor, on a real
socket; the refusal comes before any servicer code runs."""

from __future__ import annotations

import asyncio
import logging

import grpc

from loraserve.grpc_token import server_interceptors
from loraserve.grpc_utils import new_server
from loraserve.v1 import adapter_store_pb2_grpc, gateway_pb2

CHUNK = gateway_pb2.UploadAdapterRequest(chunk=gateway_pb2.FileChunk(file="a", data=b"x" * (4 << 20)))


async def _tokenless_uploads(count: int) -> list[grpc.StatusCode]:
    server, port = new_server("127.0.0.1:0", interceptors=server_interceptors("t" * 40))
    adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(adapter_store_pb2_grpc.AdapterStoreServicer(), server)
    await server.start()
    codes = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)

            async def chunks():
                for _ in range(50):  # 200 MiB, if nobody stopped it
                    yield CHUNK

            for _ in range(count):
                try:
                    await stub.Upload(chunks(), timeout=20)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
    finally:
        await server.stop(0)
    return codes


def test_a_tokenless_upload_is_refused_unauthenticated_without_an_error_logged(caplog):
    with caplog.at_level(logging.WARNING):
        codes = asyncio.run(_tokenless_uploads(3))
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
