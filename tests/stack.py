"""Real-process stacks for end-to-end tests, and an OTLP collector that keeps spans in memory."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections import defaultdict
from concurrent import futures
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from loraserve.launcher import Ports, Stack, role_commands, wait_healthy
from loraserve.v1 import gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc


def free_port_block(size: int) -> int:
    """A base port with `size` consecutive free ports after it (best effort)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + size >= 65000:
            continue
        try:
            sockets = []
            for port in range(base, base + size):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free port block")


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
                            {"service": service, "name": span.name, "trace_id": span.trace_id.hex(),
                             "attributes": attributes}
                        )  # fmt: skip
        return trace_service_pb2.ExportTraceServiceResponse()

    def traces(self) -> dict[str, list[dict]]:
        with self.lock:
            grouped: dict[str, list[dict]] = defaultdict(list)
            for span in self.spans:
                grouped[span["trace_id"]].append(span)
            return dict(grouped)

    def stop(self) -> None:
        self.server.stop(0)


class LocalStack:
    """The stack `loraserve up` runs, started by the test so it can reach (and kill) each process."""

    def __init__(self, model: Path, workers: int, collector: Collector | None = None, **overrides):
        self.base = free_port_block(6)
        self.ports = Ports(self.base)
        self.address = f"127.0.0.1:{free_port_block(1)}"
        args = argparse.Namespace(
            model=model, workers=workers, device="cpu", bind=self.address, base_port=self.base, adapter=[],
            adapter_root=overrides.pop("adapter_root", None), pool_pages=overrides.pop("pool_pages", 512),
            max_batch_size=overrides.pop("max_batch_size", 8), worker_timeout=overrides.pop("worker_timeout", 2.0),
            child_log_level="WARNING", trace_exporter="otlp" if collector else "none",
            otlp_endpoint=collector.endpoint if collector else "http://127.0.0.1:4317",
        )  # fmt: skip
        if overrides:
            raise TypeError(f"unknown overrides {sorted(overrides)}")
        self.stack = Stack(role_commands(args))

    def start(self, timeout_s: float = 180.0) -> LocalStack:
        import os

        os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "200")  # export spans quickly
        self.stack.start()
        try:
            wait_healthy([self.ports.store, self.ports.scheduler, self.address], self.stack, timeout_s)
        except Exception:
            self.stop()
            raise
        self.channel = grpc.insecure_channel(self.address)
        self.api = gateway_pb2_grpc.LoraServeStub(self.channel)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(self.ports.scheduler))
        return self

    def cluster(self) -> scheduler_pb2.ClusterState:
        return self.scheduler.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=5)

    def wait_workers(self, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(w.ready for w in self.cluster().workers) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} workers not ready after {timeout_s} s")
            time.sleep(0.2)

    def process(self, name: str):
        return self.stack.children[name]

    def stop(self) -> None:
        self.stack.stop(timeout_s=10.0)
