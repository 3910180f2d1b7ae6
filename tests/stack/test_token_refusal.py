"""An internal port refuses a tokenless upload cleanly, and logs no error for it.

A real grpc.aio server with the token interceptor, on a real socket; the refusal comes before any
servicer code runs. The server says "refused" at once (initial metadata) and reads on for a bounded
time and size (`refuse_stream`), so a relay that stops writing when told, as the gateway's
`forward_stream` does, and a client whose upload fits in that bound both get UNAUTHENTICATED. A
grpc.aio client that streams on past the bound races its own write with the status and may see
INTERNAL "Internal error from Core" instead (docs/architecture.md): the server cannot read without
bound for a caller it refused, but it still logs nothing. The real-process version, with clients
that leave mid-refusal, is in test_log_hygiene.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from loraserve.grpc_streams import REFUSAL_DRAIN_BYTES, forward_stream
from loraserve.grpc_token import server_interceptors
from loraserve.grpc_utils import new_server
from loraserve.v1 import adapter_store_pb2_grpc, gateway_pb2

CHUNK = gateway_pb2.UploadAdapterRequest(chunk=gateway_pb2.FileChunk(file="a", data=b"x" * (1 << 20)))
BIG = 50  # MiB: far past what a refusing server reads
SMALL = REFUSAL_DRAIN_BYTES // (2 << 20)  # MiB: well within it


async def _chunks(count: int) -> AsyncIterator[gateway_pb2.UploadAdapterRequest]:
    for _ in range(count):
        yield CHUNK


async def _uploads(how: str, count: int) -> list[tuple[grpc.StatusCode, str]]:
    server, port = new_server("127.0.0.1:0", interceptors=server_interceptors("t" * 40))
    adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(adapter_store_pb2_grpc.AdapterStoreServicer(), server)
    await server.start()
    outcomes = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            for _ in range(count):
                try:
                    if how == "relay":
                        await forward_stream(stub.Upload, _chunks(BIG), timeout=20)
                    else:
                        await stub.Upload(_chunks(BIG if how == "big" else SMALL), timeout=20)
                except grpc.aio.AioRpcError as e:
                    outcomes.append((e.code(), e.details()))
    finally:
        await server.stop(0)
    return outcomes


@pytest.mark.parametrize("how", ["relay", "small", "big"])
def test_a_tokenless_upload_is_refused_without_an_error_logged(how, caplog):
    with caplog.at_level(logging.WARNING):
        outcomes = asyncio.run(_uploads(how, 3))
    assert len(outcomes) == 3
    for code, details in outcomes:
        refused = code == grpc.StatusCode.UNAUTHENTICATED and "internal token is required" in details
        raced = how == "big" and (code, details) == (grpc.StatusCode.INTERNAL, "Internal error from Core")
        assert refused or raced, outcomes
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and not _closed_loop_poll(r)], caplog.text


def _closed_loop_poll(record: logging.LogRecord) -> bool:
    """grpc.aio's completion-queue poller thread, shared by every event loop of the process, can wake
    a loop an earlier `asyncio.run` of this process already closed; asyncio then logs "Event loop is
    closed" from `PollerCompletionQueue._handle_events`. That is the test process running several
    loops one after another, not the refusing server logging an error."""
    return (
        record.name == "asyncio"
        and "PollerCompletionQueue._handle_events" in record.getMessage()
        and record.exc_info is not None
        and "Event loop is closed" in str(record.exc_info[1])
    )
