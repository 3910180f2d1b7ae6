"""Refusals leave every role with INVALID_ARGUMENT (or RESOURCE_EXHAUSTED), promptly.

Real processes on real sockets, driven by real gRPC clients: a path component the filesystem cannot
hold, bytes that are not protobuf (or carry invalid UTF-8) sent to each role's server, upload
streams refused mid-stream through the gateway, and an upload stream with an undecodable message.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from stack import LocalStack

from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.v1 import gateway_pb2

pytestmark = pytest.mark.slow
BAD_UTF8 = b"\x0a\x02\xff\xfe"  # field 1 (a string in every request below), 2 bytes of invalid UTF-8
CORRUPT = b"\xff\xff\xff"  # not a protobuf at all


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-root")
    stack = LocalStack(DEMO_MODEL_DIR, 1, adapter_root=str(root))
    stack.root = Path(root)
    stack.start()
    yield stack
    stack.stop()


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


@pytest.mark.parametrize("path", ["a" * 300, "team/" + "b" * 256, "c/" * 2100])
def test_a_path_the_filesystem_cannot_hold_is_invalid_argument(stack, path):
    request = gateway_pb2.RegisterAdapterFromPathRequest(name="long", path=path)
    error = _refused(lambda: stack.api.RegisterAdapterFromPath(request, timeout=10))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith("path: ")


@pytest.mark.parametrize("payload", [BAD_UTF8, CORRUPT], ids=["bad-utf8", "corrupt"])
@pytest.mark.parametrize(
    ("role", "method"),
    [
        ("gateway", "/loraserve.v1.LoraServe/Generate"),
        ("gateway", "/loraserve.v1.LoraServe/GenerateStream"),
        ("gateway", "/loraserve.v1.LoraServe/Tokenize"),
        ("store", "/loraserve.v1.AdapterStore/Describe"),
        ("scheduler", "/loraserve.v1.Scheduler/Cancel"),
    ],
)
def test_undecodable_requests_are_invalid_argument_in_every_role(stack, role, method, payload):
    address = {"gateway": stack.address, "store": stack.ports.store, "scheduler": stack.ports.scheduler}[role]
    metadata = stack.internal_metadata if role != "gateway" else None
    with grpc.insecure_channel(address) as channel:
        if method.endswith("Stream"):
            call = channel.unary_stream(method)
            error = _refused(lambda: list(call(payload, timeout=10, metadata=metadata)))
        else:
            error = _refused(lambda: channel.unary_unary(method)(payload, timeout=10, metadata=metadata))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert error.details().startswith("request: is not a valid loraserve.v1.")


def _bad_file_upload(chunks: int = 100):
    yield gateway_pb2.UploadAdapterRequest(header=gateway_pb2.UploadHeader(name="multi"))
    for _ in range(chunks):
        yield gateway_pb2.UploadAdapterRequest(chunk=gateway_pb2.FileChunk(file="weights.pt", data=b"x" * 65536))


def test_a_multi_chunk_upload_refused_mid_stream_is_invalid_argument_every_time(stack):
    codes = []
    for _ in range(25):  # the status used to race with the gateway's relay: INTERNAL about half the time
        error = _refused(lambda: stack.api.UploadAdapter(_bad_file_upload(), timeout=20))
        codes.append((error.code().name, error.details()[:39]))
    assert set(codes) == {("INVALID_ARGUMENT", "chunk.file: unknown file 'weights.pt'; ")}, codes


def test_an_upload_stream_with_an_undecodable_message_ends_promptly(stack):
    header = gateway_pb2.UploadAdapterRequest(header=gateway_pb2.UploadHeader(name="raw")).SerializeToString()
    upload = stack.channel.stream_unary("/loraserve.v1.LoraServe/UploadAdapter")
    started = time.monotonic()
    error = _refused(lambda: upload(iter([header, CORRUPT]), timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert "UploadAdapterRequest" in error.details()
    assert time.monotonic() - started < 5  # it used to hang until the client's deadline (the relay: 600 s)
    assert "raw" not in [a.name for a in stack.api.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=5).adapters]
