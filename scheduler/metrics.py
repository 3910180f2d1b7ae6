"""The scheduler's Prometheus metrics (served when it runs with --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

QUEUE_LENGTH = Gauge("loraserve_scheduler_queue_length", "Requests waiting for a worker")
READY_WORKERS = Gauge("loraserve_scheduler_ready_workers", "Workers reporting ready")
ASSIGNED = Counter("loraserve_scheduler_assigned_requests", "Requests placed on a worker")
FAILED = Counter("loraserve_scheduler_failed_requests", "Requests the scheduler ended, by gRPC status", ["code"])
REFUSED = Counter(
    "loraserve_scheduler_refused_requests",
    "Submits refused at admission (queue full, early abort), by gRPC status",
    ["code"],
)
PREFETCH_HINTS = Counter("loraserve_scheduler_prefetch_hints", "Adapters named in prefetch hints sent to workers")
ADAPTER_HINTS = Counter(
    "loraserve_scheduler_adapter_hints", "Gateways' early adapter hints (PrepareAdapter) that started a worker's fetch"
)
WORKER_DISCONNECTS = Counter(
    "loraserve_scheduler_worker_socket_disconnects", "TCP disconnects seen on the workers' socket (any peer)"
)
MIGRATED = Counter("loraserve_scheduler_migrated_requests", "Requests moved off an overloaded worker")
