"""`loraserve worker`: one engine on one device, serving what the scheduler assigns."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading

from loraserve.config_cli import add_config_arguments, config_from_args
from loraserve.internal_auth import check_open_planes, load_optional
from loraserve.process import add_service_arguments, run_service
from loraserve.supervise import RoleFailed
from loraserve.worker.cli import add_engine_arguments, engine_config_from_args
from loraserve.worker.config import WorkerConfig
from loraserve.worker.cpu_cores import parse_cores, pin, pin_every_thread, pinned
from loraserve.worker.engine import Engine
from loraserve.worker.service import WorkerService

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_config_arguments(parser, WorkerConfig)
    add_service_arguments(parser)


def main(args: argparse.Namespace) -> int:
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    return run_service("worker", args, lambda stop: serve(args, worker_id, stop), title=f"worker {worker_id}")


def serve(args: argparse.Namespace, worker_id: str, stop: threading.Event) -> None:
    """Load the engine and run the worker's step loop until `stop` (then drain)."""
    keys = load_optional(args.internal_keys, "worker")
    check_open_planes("worker", keys, [], args.insecure_no_internal_auth)  # it listens nowhere: a warning
    config = config_from_args(WorkerConfig, args, worker_id=worker_id, keys=keys)
    cores = parse_cores(config.cpu_cores)
    with pinned(cores):  # torch's threads start here, and stay on those cores
        if config.torch_threads:
            import torch

            torch.set_num_threads(config.torch_threads)
        engine = Engine(args.model, engine_config_from_args(args))
    service = WorkerService(engine, config)  # its I/O, fetch and build threads (and ZMQ's): on any core
    pin(cores)  # the step loop
    if config.pin_all_threads:
        pin_every_thread(cores)
    if args.metrics_port:
        from prometheus_client import REGISTRY

        from loraserve.worker.metrics import WorkerCollector

        engine = service.engine
        REGISTRY.register(
            WorkerCollector(
                lambda: service.last_report,
                engine.pool.stats,
                engine.registry,
                engine.step_scheduler,
                resident_count=lambda: service.reporter.resident_count,
            )
        )
    try:
        service.run(stop)
    except Exception as e:  # logged with its traceback by service.run, which also told the scheduler
        raise RoleFailed(f"worker {worker_id} stopped on an unexpected error: {e}") from e
