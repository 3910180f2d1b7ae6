"""A running stack logs no error for ordinary events: streams cancelled by their clients (gRPC and
HTTP) leave no traceback in the gateway's log (OpenTelemetry once logged "Failed to detach context"
for each, because the request's span was made current across the stream's `yield`s and closed in
another context). Real processes; the roles' log is read where they write it."""

from __future__ import annotations

import json
import socket
import time

import grpc
import pytest
from stack import LocalStack, free_port_block

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.v1 import gateway_pb2, gateway_pb2_grpc

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
