"""`loraserve gateway`: the public gRPC API."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import grpc

from loraserve import telemetry
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.gateway.auth import AllowAll
from loraserve.gateway.service import GatewayConfig, LoraServeService
from loraserve.gateway.token_sink import TokenSink
from loraserve.gateway.validation import Limits
from loraserve.grpc_utils import add_health_and_reflection, internal_channel, new_server, set_serving
from loraserve.metrics import add_metrics_arguments
from loraserve.process import run_service
from loraserve.supervise import health_off, supervise
from loraserve.tokenizer import Tokenizer
from loraserve.v1 import (
    adapter_store_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from loraserve.worker.model_config import ModelConfig

log = logging.getLogger(__name__)
SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["LoraServe"].full_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="127.0.0.1:50051", help="public gRPC address")
    parser.add_argument(
        "--model", type=Path, default=DEMO_MODEL_DIR, help="model directory (tokenizer.json, config.json)"
    )
    parser.add_argument("--scheduler", default="127.0.0.1:7100", help="the scheduler's gRPC address")
    parser.add_argument("--store", default="127.0.0.1:7300", help="the adapter store's gRPC address")
    parser.add_argument("--token-address", default="tcp://127.0.0.1:7201", help="ZMQ address the token sink binds")
    parser.add_argument(
        "--token-advertise", default=None, help="address workers push tokens to (default: --token-address)"
    )
    parser.add_argument("--max-context", type=int, default=None, help="default: the model's max positions")
    parser.add_argument("--default-max-new-tokens", type=int, default=64)
    parser.add_argument("--max-lora-rank", type=int, default=128)
    parser.add_argument(
        "--inactivity-timeout",
        type=float,
        default=60.0,
        help="fail a request that makes no progress this long",
    )
    telemetry.add_tracing_arguments(parser)
    add_metrics_arguments(parser)


async def _watch_cluster(service: LoraServeService, scheduler, health) -> None:
    """SERVING only while at least one worker is warmed up (asked of the scheduler twice a second)."""
    serving = None
    while True:
        try:
            state = await scheduler.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=1.0)
            ready = sum(1 for w in state.workers if w.ready)
        except grpc.aio.AioRpcError:
            ready = 0
        service.ready_workers = ready
        if (ready > 0) != serving:
            serving = ready > 0
            await set_serving(health, [SERVICE], serving)
            log.info("gateway health: %s (%d ready workers)", "SERVING" if serving else "NOT_SERVING", ready)
        await asyncio.sleep(0.5)


async def serve(args: argparse.Namespace, stop_event) -> None:
    model = ModelConfig.from_dir(args.model)
    tokenizer = Tokenizer.from_model_dir(args.model)
    limits = Limits(
        vocab_size=model.vocab_size,
        max_context=args.max_context or model.max_position_embeddings,
        default_max_new_tokens=args.default_max_new_tokens,
    )
    sink = TokenSink(args.token_address)
    if args.token_advertise:
        sink.address = args.token_advertise
    scheduler = scheduler_pb2_grpc.SchedulerStub(internal_channel(args.scheduler))
    store = adapter_store_pb2_grpc.AdapterStoreStub(internal_channel(args.store))
    config = GatewayConfig(
        Path(args.model).name,
        model.model_type,
        args.max_lora_rank,
        inactivity_timeout_s=args.inactivity_timeout,
    )
    service = LoraServeService(config, limits, tokenizer, sink, scheduler, store, AllowAll())
    server, port = new_server(args.bind)
    gateway_pb2_grpc.add_LoraServeServicer_to_server(service, server)
    health = add_health_and_reflection(server, [SERVICE])
    await set_serving(health, [SERVICE], False)
    await server.start()
    log.info("gateway: gRPC on %s (port %d), token sink %s", args.bind, port, sink.address)
    tasks = {"token sink": sink.run(), "cluster watch": _watch_cluster(service, scheduler, health)}
    try:
        await supervise("gateway", tasks, stop_event, health_off(health, [SERVICE]))
    finally:
        await server.stop(grace=2.0)
        sink.shutdown()


def main(args: argparse.Namespace) -> int:
    return run_service("gateway", args, lambda stop: serve(args, stop))
