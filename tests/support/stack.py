"""Real-process stacks for end-to-end tests, and an OTLP collector that keeps spans in memory."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from loraserve.launcher.local_stack import LocalStack as _LocalStack
from loraserve.launcher.ports import free_port_block
from loraserve.v1 import gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

__all__ = ["Collector", "LocalStack", "LoneGateway", "free_port_block", "http_stack", "lone_gateway"]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: the roles export real OTLP; the test reads the spans here."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), "?"
                )
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        attributes = {a.key: a.value.string_value or a.value.int_value for a in span.attributes}
                        self.spans.append(
                            {
                                "service": service,
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "attributes": attributes,
                            }
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def traces(self) -> dict[str, list[dict]]:
        with self.lock:
            grouped: dict[str, list[dict]] = defaultdict(list)
            for span in self.spans:
                grouped[span["trace_id"]].append(span)
            return dict(grouped)

    def stop(self) -> None:
        self.server.stop(0)


class LocalStack(_LocalStack):
    """The launcher's local stack plus the clients a test needs; tracing goes to `collector`."""

    def __init__(self, model: Path, workers: int, collector: Collector | None = None, **options):
        options.setdefault("pool_pages", 512)
        options.setdefault("max_batch_size", 8)
        options.setdefault("worker_timeout", 2.0)
        if collector is not None:
            options.update(trace_exporter="otlp", otlp_endpoint=collector.endpoint)
        super().__init__(model, workers, **options)

    def start(self, timeout_s: float = 180.0) -> LocalStack:
        os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "200")  # export spans quickly
        super().start(timeout_s)
        self.channel = grpc.insecure_channel(self.address)
        self.api = gateway_pb2_grpc.LoraServeStub(self.channel)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(self.ports.scheduler))
        self.internal_metadata = (("authorization", f"Bearer {self.internal_token}"),)  # internal ports want it
        return self

    def cluster(self) -> scheduler_pb2.ClusterState:
        return self.scheduler.GetClusterState(
            scheduler_pb2.GetClusterStateRequest(), timeout=5, metadata=self.internal_metadata
        )

    def wait_workers(self, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(w.ready for w in self.cluster().workers) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} workers not ready after {timeout_s} s")
            time.sleep(0.2)


@contextlib.contextmanager
def http_stack(**options) -> Iterator[LocalStack]:
    """A started one-worker stack of the demo model that serves the HTTP API too, on a free port
    (`stack.http_port`, `stack.http_url`); stopped on exit. `options`: LocalStack's."""
    from loraserve.demo.assets import DEMO_MODEL_DIR

    port = free_port_block(1)
    stack = LocalStack(DEMO_MODEL_DIR, workers=1, http_bind=f"127.0.0.1:{port}", **options)
    stack.http_port, stack.http_url = port, f"http://127.0.0.1:{port}"
    stack.start()
    try:
        stack.wait_workers(1)
        yield stack
    finally:
        stack.stop()


def scrape_metrics(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a role's /metrics, read by prometheus-client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@dataclass
class LoneGateway:
    process: subprocess.Popen
    http_port: int
    key: str  # the one tenant's API key (scope generate)


@contextlib.contextmanager
def lone_gateway(home: Path, *flags: str, key: str = "key-of-a-0123456789") -> Iterator[LoneGateway]:
    """A real gateway process with the HTTP API and an auth file (one tenant, `key`), alone: no
    scheduler or store behind it, so it answers what it decides by itself (auth, limits, refusals)."""
    auth = home / "auth.toml"
    digest = hashlib.sha256(key.encode()).hexdigest()
    auth.write_text(f'[[tenants]]\nname = "a"\napi_key_sha256 = ["{digest}"]\nscopes = ["generate"]\n')
    base = free_port_block(5)
    command = [sys.executable, "-m", "loraserve.cli", "gateway", "--bind", f"127.0.0.1:{base}"]
    command += ["--scheduler", f"127.0.0.1:{base + 1}", "--store", f"127.0.0.1:{base + 2}"]
    command += ["--token-address", f"tcp://127.0.0.1:{base + 3}", "--http-bind", f"127.0.0.1:{base + 4}"]
    command += ["--auth-file", str(auth), "--scheduler-grace", "0.5", *flags]
    log = home / "gateway.log"
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", base + 4), timeout=1):
                break
            assert process.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the gateway's HTTP port did not open"
            time.sleep(0.1)
        yield LoneGateway(process, base + 4, key)
    finally:
        process.terminate()
        process.wait(timeout=30)
