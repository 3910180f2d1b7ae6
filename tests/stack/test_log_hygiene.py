"""A running stack logs no error for ordinary events: streams cancelled by their clients (gRPC and
HTTP) leave no traceback in the gateway's log (OpenTelemetry once logged "Failed to detach context"
for each, because the request's span was made current across the stream's `yield`s and closed in
another context), and a tokenless upload to the store whose client leaves while it is refused
leaves none in the store's (its status could not be sent, and a second abort logged "Abort already
called!"). Real processes; the roles' log is read where they write it."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import grpc
import pytest
from stack import LocalStack, free_port_block
from store_proc import StoreProcess

from loraserve import internal_auth
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.v1 import adapter_store_pb2_grpc, gateway_pb2, gateway_pb2_grpc

CHUNK = gateway_pb2.UploadAdapterRequest(chunk=gateway_pb2.FileChunk(file="a", data=b"x" * (1 << 20)))

pytestmark = pytest.mark.slow


def test_cancelled_streams_leave_no_error_in_the_log(capfd, collector):
    stack = LocalStack(DEMO_MODEL_DIR, 1, collector, child_log_level="WARNING").start()
    try:
        stack.wait_workers(1)
        with grpc.insecure_channel(stack.address) as channel:
            stub = gateway_pb2_grpc.LoraServeStub(channel)
            for _ in range(3):
                request = gateway_pb2.GenerateRequest(text="the quiet king", max_new_tokens=200)
                call = stub.GenerateStream(request, timeout=30)
                next(call)  # the stream has begun
                call.cancel()
        time.sleep(1.0)  # the gateway closes the cancelled streams
        output = capfd.readouterr().err
        assert "Failed to detach context" not in output, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    finally:
        stack.stop()


def test_http_streams_whose_client_leaves_leave_no_error_in_the_log(capfd, collector):
    port = free_port_block(1)
    stack = LocalStack(DEMO_MODEL_DIR, 1, collector, http_bind=f"127.0.0.1:{port}", child_log_level="WARNING").start()
    try:
        stack.wait_workers(1)
        body = json.dumps({"model": "model", "prompt": "the quiet king", "max_tokens": 200, "stream": True})
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n{body}".encode()
                )
                assert b"data:" in sock.recv(65536) or b"data:" in sock.recv(65536)  # the stream has begun
        time.sleep(1.0)  # the gateway notices, and closes the streams
        output = capfd.readouterr().err
        assert "Failed to detach context" not in output, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
    finally:
        stack.stop()


async def _tokenless_uploads(address: str, leaving: int) -> list[grpc.StatusCode]:
    """Uploads without the internal token: three that wait for their status, then `leaving` whose
    client cancels or closes its channel while the refusal is being made."""
    codes = []
    for i in range(3 + leaving):
        channel = grpc.aio.insecure_channel(address)
        call = adapter_store_pb2_grpc.AdapterStoreStub(channel).Upload(timeout=10)
        try:
            await call.write(CHUNK)
            if i < 3:
                await call.done_writing()
                codes.append(await call.code())
            elif i % 2:
                await asyncio.sleep(0.001 * (i % 7))
                call.cancel()
            else:
                await channel.close()  # the client process dies
        except grpc.aio.AioRpcError as e:
            if i < 3:
                codes.append(e.code())
        finally:
            await channel.close()
    return codes


def test_tokenless_uploads_are_refused_without_a_traceback_even_when_their_client_leaves(tmp_path):
    keys = internal_auth.generate(tmp_path / "keys")
    store = StoreProcess(tmp_path, "--internal-keys", str(keys)).wait_serving()
    try:
        codes = asyncio.run(_tokenless_uploads(store.address, leaving=16))
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3
        time.sleep(0.5)  # the store finishes the refused calls
        assert store.proc.poll() is None
    finally:
        store.stop()
    output = store.log.read_text(errors="replace")
    assert "restored" in output, output[-3000:]  # the log is the store's
    for sign in ("Traceback", "Abort already called", " ERROR "):
        assert sign not in output, output[-3000:]
