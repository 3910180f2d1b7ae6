"""`loraserve scheduler`: the admission and placement service."""

from __future__ import annotations

import argparse
import logging

from loraserve.config_cli import add_config_arguments, config_from_args
from loraserve.grpc_token import server_interceptors
from loraserve.grpc_utils import add_health_and_reflection, new_server, set_serving
from loraserve.internal_auth import check_open_planes, load_optional
from loraserve.process import add_service_arguments, run_service
from loraserve.scheduler.config import SchedulerConfig
from loraserve.scheduler.loop import SchedulerLoop
from loraserve.scheduler.policy import SchedulerPolicy
from loraserve.scheduler.service import SchedulerService
from loraserve.supervise import health_off, supervise
from loraserve.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)
SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, SchedulerConfig)
    add_service_arguments(parser)


async def serve(args: argparse.Namespace, stop_event) -> None:
    """Serve until `stop_event`; if the loop dies, health goes NOT_SERVING and RoleFailed (exit 1) follows."""
    config = config_from_args(SchedulerConfig, args)
    policy = SchedulerPolicy(config.policy)
    keys = load_optional(args.internal_keys, "scheduler")
    check_open_planes("scheduler", keys, [config.bind, config.worker_address], args.insecure_no_internal_auth)
    loop = SchedulerLoop(policy, config.worker_address, keys=keys)
    server, _ = new_server(config.bind, interceptors=server_interceptors(keys.token if keys else None))
    service = SchedulerService(loop)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server)
    health = add_health_and_reflection(server, [SERVICE])
    await server.start()
    await set_serving(health, [SERVICE], True)
    log.info(
        "scheduler: gRPC on %s, workers on %s, policy %s", config.bind, config.worker_address, policy.config.policy
    )
    try:
        await supervise("scheduler", {"scheduler loop": loop.run()}, stop_event, health_off(health, [SERVICE]))
    finally:
        service.stopping = True
        await server.stop(grace=1.0)


def main(args: argparse.Namespace) -> int:
    return run_service("scheduler", args, lambda stop: serve(args, stop))
