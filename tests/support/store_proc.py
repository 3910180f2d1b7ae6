"""`loraserve adapter-store` as a real child process, with clients for both of its planes.

Each store gets its own data dir below the test's temp dir unless the flags name one (or an
object store), so stores of different tests never share state.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraserve.adapter_store.client import AdapterFetcher
from loraserve.demo.assets import demo_adapters
from loraserve.v1 import adapter_store_pb2_grpc, common_pb2, gateway_pb2

SERVICE = "loraserve.v1.AdapterStore"
CHUNK = 64 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def files(name: str) -> tuple[bytes, bytes]:
    directory = demo_adapters()[name]
    return (directory / "adapter_config.json").read_bytes(), (directory / "adapter_model.safetensors").read_bytes()


class StoreProcess:
    """`loraserve adapter-store` in a child process; `env` adds variables (LORASERVE_* ones are removed)."""

    def __init__(self, tmp: Path, *flags: str, env: dict[str, str] | None = None):
        self.address = f"127.0.0.1:{free_port()}"
        self.data_address = f"tcp://127.0.0.1:{free_port()}"
        port = self.address.rsplit(":", 1)[1]
        self.log = tmp / f"store-{port}.log"
        if "--data-dir" not in flags and "--object-store" not in flags:
            flags = (*flags, "--data-dir", str(tmp / f"store-data-{port}"))
        environment = {k: v for k, v in os.environ.items() if not k.startswith("LORASERVE_")} | (env or {})
        command = [
            sys.executable,
            "-m",
            "loraserve.cli",
            "adapter-store",
            "--bind",
            self.address,
            "--data-address",
            self.data_address,
            *flags,
        ]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = adapter_store_pb2_grpc.AdapterStoreStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.fetcher = AdapterFetcher(self.data_address, timeout_s=5.0)

    def wait_serving(self, timeout_s: float = 60.0) -> StoreProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the store exited with {self.proc.returncode}:\n{self.output()}")
            try:
                reply = self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        pytest.fail(f"the store was not SERVING within {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def listed(self) -> dict[str, common_pb2.AdapterInfo]:
        return {a.name: a for a in self.stub.List(gateway_pb2.ListAdaptersRequest(), timeout=5).adapters}

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind, as in a crash or an OOM kill."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.fetcher.close()
        self.channel.close()

    def stop(self) -> None:
        self.fetcher.close()
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def upload_requests(name: str | None, parts: list[tuple[str, bytes]], chunk: int = CHUNK) -> Iterator:
    if name is not None:
        yield gateway_pb2.UploadAdapterRequest(header=gateway_pb2.UploadHeader(name=name))
    for file, data in parts:
        for start in range(0, len(data), chunk):
            piece = gateway_pb2.FileChunk(file=file, data=data[start : start + chunk])
            yield gateway_pb2.UploadAdapterRequest(chunk=piece)


def upload(store: StoreProcess, name: str, adapter: str) -> common_pb2.AdapterInfo:
    config, weights = files(adapter)
    parts = [("adapter_config.json", config), ("adapter_model.safetensors", weights)]
    return store.stub.Upload(upload_requests(name, parts), timeout=30)
