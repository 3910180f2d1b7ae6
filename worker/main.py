"""`loraserve worker`: one engine on one device, serving what the scheduler assigns."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
from pathlib import Path

from loraserve import telemetry
from loraserve.internal_auth import add_internal_keys_argument, check_open_planes, load_optional
from loraserve.metrics import add_metrics_arguments
from loraserve.process import add_drain_argument, run_service
from loraserve.supervise import RoleFailed
from loraserve.worker.cli import add_engine_arguments, engine_config_from_args
from loraserve.worker.engine import Engine
from loraserve.worker.service import WorkerConfig, WorkerService

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--worker-id", default=None, help="unique name (default: host-pid)")
    parser.add_argument(
        "--scheduler-address", default="tcp://127.0.0.1:7101", help="the scheduler's ZMQ worker address"
    )
    parser.add_argument("--store-address", default="tcp://127.0.0.1:7301", help="the adapter store's ZMQ data address")
    parser.add_argument("--report-interval", type=float, default=0.25, help="heartbeat period when idle, seconds")
    add_drain_argument(parser, "to let requests in flight finish before handing them back to fail over")
    parser.add_argument(
        "--fetch-timeout", type=float, default=10.0, help="seconds to wait for an adapter from the store"
    )
    parser.add_argument(
        "--adapter-rows",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fetch adapters already packed in the pool's row layout when the store has them, instead of their "
        "files to parse, validate and pack here (--no-adapter-rows: the files)",
    )
    parser.add_argument(
        "--shared-memory-root",
        default="/dev/shm",
        metavar="DIR",
        help="the store's --shared-memory-root: rows of a store on this host and user are mapped from there, "
        "not received over the socket; empty: the socket only",
    )
    parser.add_argument(
        "--verify-shared-memory",
        action="store_true",
        help="hash rows mapped from shared memory against the store's digests too (rows over the socket always are)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op CPU threads (default: torch's choice; fewer when other roles share the CPU)",
    )
    add_internal_keys_argument(parser)
    telemetry.add_tracing_arguments(parser)
    add_metrics_arguments(parser)


def main(args: argparse.Namespace) -> int:
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    return run_service("worker", args, lambda stop: serve(args, worker_id, stop), title=f"worker {worker_id}")


def serve(args: argparse.Namespace, worker_id: str, stop: threading.Event) -> None:
    """Load the engine and run the worker's step loop until `stop` (then drain)."""
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    keys = load_optional(args.internal_keys, "worker")
    check_open_planes("worker", keys, [], args.insecure_no_internal_auth)  # it listens nowhere: a warning
    config = WorkerConfig(
        worker_id=worker_id,
        scheduler_address=args.scheduler_address,
        store_address=args.store_address,
        report_interval_s=args.report_interval,
        drain_timeout_s=args.drain_timeout,
        fetch_timeout_s=args.fetch_timeout,
        keys=keys,
        adapter_rows=args.adapter_rows,
        shm_root=Path(args.shared_memory_root) if args.shared_memory_root else None,
        verify_shared_memory=args.verify_shared_memory,
    )
    service = WorkerService(Engine(args.model, engine_config_from_args(args)), config)
    if args.metrics_port:
        from prometheus_client import REGISTRY

        from loraserve.worker.metrics import WorkerCollector

        engine = service.engine
        REGISTRY.register(
            WorkerCollector(lambda: service.last_report, engine.pool.stats, engine.registry, engine.step_scheduler)
        )
    try:
        service.run(stop)
    except Exception as e:  # logged with its traceback by service.run, which also told the scheduler
        raise RoleFailed(f"worker {worker_id} stopped on an unexpected error: {e}") from e
