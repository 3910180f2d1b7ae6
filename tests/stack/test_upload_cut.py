"""An adapter upload through the gateway whose store dies mid-upload ends UNAVAILABLE, saying the
store is unavailable and the upload may be retried: never INTERNAL.

Real processes: a store (`tests/support/store_proc.py`) and a gateway in front of it (no scheduler: uploads
do not need one). The store is SIGKILLed in two ways:

- between two of the client's messages: the gateway's connection to it is reset (UNAVAILABLE);
- from another thread while small chunks stream: now and then a write of the gateway's races with
  the broken connection, and grpc.aio then reports the call INTERNAL ("Internal error from Core").
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from stack import free_port_block
from store_proc import StoreProcess, files

from loraserve.errors import UnavailableError
from loraserve.gateway.store_client import StoreClient
from loraserve.v1 import adapter_store_pb2, adapter_store_pb2_grpc, gateway_pb2, gateway_pb2_grpc

CHUNK = 4096
CHUNKS = 8192  # 32 MiB of small chunks: the gateway writes to the store as fast as it can


class Gateway:
    """`loraserve gateway` in a child process, in front of `store` alone."""

    def __init__(self, tmp: Path, store: StoreProcess):
        base = free_port_block(3)
        command = [sys.executable, "-m", "loraserve.cli", "gateway", "--bind", f"127.0.0.1:{base}"]
        command += ["--scheduler", f"127.0.0.1:{base + 1}", "--store", store.address]
        command += ["--token-address", f"tcp://127.0.0.1:{base + 2}"]
        self.log = tmp / f"gateway-{base}.log"
        with self.log.open("w") as output:
            self.proc = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{base}")
        self.api = gateway_pb2_grpc.LoraServeStub(self.channel)
        deadline = time.monotonic() + 60
        while True:  # up, and through to the store
            try:
                self.api.ListAdapters(gateway_pb2.ListAdaptersRequest(), timeout=2)
                return
            except grpc.RpcError:
                assert self.proc.poll() is None, self.log.read_text()[-2000:]
                assert time.monotonic() < deadline, "the gateway did not answer"
                time.sleep(0.1)

    def stop(self) -> None:
        self.channel.close()
        self.proc.terminate()
        self.proc.wait(30)


def _upload(started: Callable[[], None]) -> Iterator[gateway_pb2.UploadAdapterRequest]:
    """A large upload that calls `started()` after its first chunks."""
    config, _ = files("upper")
    yield gateway_pb2.UploadAdapterRequest(header=gateway_pb2.UploadHeader(name="cut-short"))
    yield gateway_pb2.UploadAdapterRequest(chunk=gateway_pb2.FileChunk(file="adapter_config.json", data=config))
    for i in range(CHUNKS):
        if i == 4:
            started()
        chunk = gateway_pb2.FileChunk(file="adapter_model.safetensors", data=bytes(CHUNK))
        yield gateway_pb2.UploadAdapterRequest(chunk=chunk)


# when the store is killed, counted from the upload's fifth chunk: at once (between two of the
# client's messages), or from another thread while chunks stream (a write of the gateway's may
# then race with the broken connection)
@pytest.mark.slow
@pytest.mark.parametrize("kill_after_s", [0.0, 0.05, 0.1])
def test_an_upload_whose_store_dies_ends_unavailable_and_says_retry(tmp_path, kill_after_s):
    store = StoreProcess(tmp_path).wait_serving()
    gateway = Gateway(tmp_path, store)

    def kill() -> None:
        if kill_after_s:
            threading.Timer(kill_after_s, store.proc.send_signal, (signal.SIGKILL,)).start()
        else:
            store.proc.send_signal(signal.SIGKILL)

    try:
        with pytest.raises(grpc.RpcError) as failure:
            gateway.api.UploadAdapter(_upload(kill), timeout=30)
        code, details = failure.value.code(), failure.value.details()
        assert code == grpc.StatusCode.UNAVAILABLE, f"{code.name}: {details}"
        assert "adapter store is unavailable" in details, details
        assert "may be retried" in details, details
    finally:
        gateway.stop()
        store.stop()


class _InternalOnUpload(adapter_store_pb2_grpc.AdapterStoreServicer):
    """A store whose Upload fails INTERNAL, as grpc.aio reports a write that raced a broken connection."""

    async def Upload(self, request_iterator, context):
        await context.abort(grpc.StatusCode.INTERNAL, "Internal error from Core")

    async def GetStoreState(self, request, context):
        return adapter_store_pb2.StoreState()


async def _relay_internal(store_alive: bool) -> BaseException:
    """The gateway's upload relay against a store whose Upload ends INTERNAL; the probe that follows
    reaches that store (alive) or a closed port (dead). Returns what the relay raised."""
    server = grpc.aio.server()
    adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(_InternalOnUpload(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    upload_channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    probe_channel = grpc.aio.insecure_channel(f"127.0.0.1:{port if store_alive else free_port_block(1)}")
    store = adapter_store_pb2_grpc.AdapterStoreStub(upload_channel)
    store.GetStoreState = adapter_store_pb2_grpc.AdapterStoreStub(probe_channel).GetStoreState
    client = StoreClient(store, timeout_s=5.0)

    async def requests():
        yield gateway_pb2.UploadAdapterRequest(header=gateway_pb2.UploadHeader(name="a"))

    try:
        await client.relay_upload(requests(), timeout=5.0)
    except BaseException as e:
        return e
    finally:
        await upload_channel.close()
        await probe_channel.close()
        await server.stop(0)
    raise AssertionError("the relay succeeded")


def test_an_internal_upload_failure_of_a_store_that_no_longer_answers_is_unavailable():
    error = asyncio.run(_relay_internal(store_alive=False))
    assert isinstance(error, UnavailableError), repr(error)
    assert "may be retried" in str(error)


def test_an_internal_upload_failure_of_a_store_that_answers_stays_its_own():
    error = asyncio.run(_relay_internal(store_alive=True))
    assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.INTERNAL, repr(error)
