"""`loraserve scheduler`: the admission and placement service."""

from __future__ import annotations

import argparse
import logging

from loraserve import telemetry
from loraserve.grpc_token import server_interceptors
from loraserve.grpc_utils import add_health_and_reflection, new_server, set_serving
from loraserve.internal_auth import add_internal_keys_argument, check_open_planes, load_optional
from loraserve.metrics import add_metrics_arguments
from loraserve.process import run_service
from loraserve.scheduler.loop import SchedulerLoop
from loraserve.scheduler.policy import POLICIES, PolicyConfig, SchedulerPolicy
from loraserve.scheduler.service import SchedulerService
from loraserve.supervise import health_off, supervise
from loraserve.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)
SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="127.0.0.1:7100", help="gRPC address gateways call")
    parser.add_argument("--worker-address", default="tcp://127.0.0.1:7101", help="ZMQ address workers connect to")
    parser.add_argument("--max-queue-length", type=int, default=1024)
    parser.add_argument(
        "--worker-timeout",
        type=float,
        default=1.5,
        help="seconds without a report before a worker is dropped (its requests fail over)",
    )
    parser.add_argument(
        "--stale-after",
        type=float,
        default=0.75,
        help="seconds without a report after which nothing new is placed on a worker",
    )
    parser.add_argument("--prefetch-depth", type=int, default=16, help="queued requests used to predict adapters")
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default=POLICIES[0],
        help="scheduling policy: adaptive (cost model, multi-queue, VTC fairness, early refusal, migration, "
        "scored prefetch) or fcfs (first come first served, busiest worker); see docs/architecture.md",
    )
    add_internal_keys_argument(parser)
    telemetry.add_tracing_arguments(parser)
    add_metrics_arguments(parser)


async def serve(args: argparse.Namespace, stop_event) -> None:
    """Serve until `stop_event`; if the loop dies, health goes NOT_SERVING and RoleFailed (exit 1) follows."""
    config = PolicyConfig.of(
        args.policy,
        max_queue_length=args.max_queue_length,
        prefetch_depth=args.prefetch_depth,
        worker_timeout_s=args.worker_timeout,
        stale_after_s=args.stale_after,
    )
    policy = SchedulerPolicy(config)
    keys = load_optional(args.internal_keys, "scheduler")
    check_open_planes("scheduler", keys, [args.bind, args.worker_address], args.insecure_no_internal_auth)
    loop = SchedulerLoop(policy, args.worker_address, keys=keys)
    server, _ = new_server(args.bind, interceptors=server_interceptors(keys.token if keys else None))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerService(loop), server)
    health = add_health_and_reflection(server, [SERVICE])
    await server.start()
    await set_serving(health, [SERVICE], True)
    log.info("scheduler: gRPC on %s, workers on %s, policy %s", args.bind, args.worker_address, config.policy)
    try:
        await supervise("scheduler", {"scheduler loop": loop.run()}, stop_event, health_off(health, [SERVICE]))
    finally:
        await server.stop(grace=1.0)


def main(args: argparse.Namespace) -> int:
    return run_service("scheduler", args, lambda stop: serve(args, stop))
