"""`loraserve adapter-store`: adapters in host RAM; gRPC control plane, ZMQ data plane.

Start-up: read the base model's config.json, open the data dir or object store (a clear error and
exit 1 if it cannot be locked or written), bind the data plane (its own thread, see data_plane.py),
start gRPC with health NOT_SERVING, restore every stored adapter (catalog.py; corrupt ones are
quarantined, ones over lowered limits skipped in place), register the preloads (a preload whose
files are unchanged keeps its version), then SERVING. Stops on
SIGTERM/SIGINT: gRPC drains for a grace period, the data-plane thread closes its socket, exit 0.
If the data-plane thread or the purge task dies, health goes NOT_SERVING and the store exits 1
(`loraserve/supervise.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
from pathlib import Path

from loraserve import telemetry
from loraserve.adapter_store.catalog import Catalog, model_identity
from loraserve.adapter_store.config import (
    GIB,
    MIB,
    PersistenceConfig,
    StoreConfig,
    StoreLimits,
    default_data_dir,
    parse_preload,
)
from loraserve.adapter_store.data_plane import DataPlane
from loraserve.adapter_store.persistence import Backend, DirectoryBackend
from loraserve.adapter_store.rows import RowsMaker
from loraserve.adapter_store.service import AdapterStoreService
from loraserve.adapter_store.store import AdapterStore
from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.errors import LoraserveError
from loraserve.grpc_token import server_interceptors
from loraserve.grpc_utils import add_health_and_reflection, new_server, set_serving
from loraserve.internal_auth import add_internal_keys_argument, check_open_planes, load_optional
from loraserve.metrics import add_metrics_arguments
from loraserve.model_config import ModelConfig
from loraserve.process import run_service
from loraserve.supervise import health_off, supervise
from loraserve.v1 import adapter_store_pb2, adapter_store_pb2_grpc

log = logging.getLogger(__name__)
SERVICE = adapter_store_pb2.DESCRIPTOR.services_by_name["AdapterStore"].full_name
GRACE_S = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=Path, default=DEMO_MODEL_DIR, help="base model directory (only config.json is read)"
    )
    parser.add_argument("--bind", default="127.0.0.1:7300", help="gRPC control-plane address")
    parser.add_argument("--data-address", default="tcp://127.0.0.1:7301", help="ZMQ address workers fetch from")
    parser.add_argument(
        "--adapter-root",
        type=Path,
        default=None,
        help="directory RegisterFromPath may read below (unset: RegisterFromPath is refused)",
    )
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="register the PEFT directory PATH as NAME before serving (repeatable; in the env twin, comma-separated)",
    )
    parser.add_argument(
        "--preload-demo",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="register every demo adapter (default: on when --model is the demo model)",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="directory every registered adapter is written to before the registration is acknowledged, and "
        "reloaded from at start (re-verified; corrupt entries moved to DIR/quarantine/, never deleted; "
        "created private, mode 0700) "
        f"(default: {default_data_dir()})",
    )
    parser.add_argument(
        "--object-store",
        default=None,
        metavar="s3://BUCKET/PREFIX",
        help="keep adapters in S3-compatible object storage instead of --data-dir (credentials: the standard AWS "
        "variables or boto3's other sources; needs boto3: pip install 'loraserve[s3]')",
    )
    parser.add_argument(
        "--object-store-endpoint", default=None, metavar="URL", help="the object store's endpoint (default: AWS S3)"
    )
    parser.add_argument(
        "--memory-budget-gb", type=float, default=8.0, help="host RAM for adapters (their files and pool rows), GiB"
    )
    parser.add_argument("--max-adapter-mb", type=float, default=512.0, help="largest weights file accepted, MiB")
    parser.add_argument("--max-lora-rank", type=int, default=128, help="largest LoRA rank accepted")
    parser.add_argument(
        "--retention-s",
        type=float,
        default=600.0,
        help="seconds a superseded or deleted version stays fetchable for requests in flight",
    )
    parser.add_argument(
        "--adapter-rows",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep each version packed in the workers' pool row layout too (about its size again in RAM), so a "
        "worker copies it into its pool without parsing or packing (--no-adapter-rows: the files only)",
    )
    parser.add_argument(
        "--shared-memory-root",
        default="/dev/shm",
        metavar="DIR",
        help="a tmpfs where the packed rows live, mapped by workers on this host and user instead of sent over "
        "the socket (a private loraserve-UID directory is made there); empty: sockets only",
    )
    add_internal_keys_argument(parser)
    telemetry.add_tracing_arguments(parser)
    add_metrics_arguments(parser)


def config_from_args(args: argparse.Namespace) -> StoreConfig:
    specs = args.preload
    if isinstance(specs, str):  # from LORASERVE_PRELOAD: flags.py hands an append flag's env value over as one string
        specs = [spec for spec in specs.split(",") if spec]
    preload = [parse_preload(spec) for spec in specs]
    preload_demo = args.preload_demo
    if preload_demo is None:
        preload_demo = Path(args.model).resolve() == DEMO_MODEL_DIR.resolve()
    if preload_demo:
        explicit = {name for name, _ in preload}
        preload = [(name, path) for name, path in demo_adapters().items() if name not in explicit] + preload
    limits = StoreLimits(
        max_lora_rank=args.max_lora_rank,
        max_adapter_bytes=int(args.max_adapter_mb * MIB),
        budget_bytes=int(args.memory_budget_gb * GIB),
        retention_s=args.retention_s,
    )
    keys = load_optional(args.internal_keys, "store")
    check_open_planes("store", keys, [args.bind, args.data_address], args.insecure_no_internal_auth)
    return StoreConfig(
        model_dir=Path(args.model),
        limits=limits,
        bind=args.bind,
        data_address=args.data_address,
        adapter_root=args.adapter_root,
        preload=tuple(preload),
        persistence=persistence_from_args(args),
        keys=keys,
        adapter_rows=args.adapter_rows,
        shm_root=Path(args.shared_memory_root) if args.shared_memory_root else None,
    )


def persistence_from_args(args: argparse.Namespace) -> PersistenceConfig:
    """The CLI is always durable: --object-store if given, else --data-dir or its default."""
    if args.object_store:
        if args.data_dir:
            log.warning("--data-dir %s is ignored: adapters are kept in %s", args.data_dir, args.object_store)
        endpoint = args.object_store_endpoint or None
        return PersistenceConfig(object_store=args.object_store, object_store_endpoint=endpoint)
    if args.object_store_endpoint:
        raise LoraserveError("--object-store-endpoint is set but --object-store is not")
    return PersistenceConfig(data_dir=Path(args.data_dir) if args.data_dir else default_data_dir())


def open_catalog(config: PersistenceConfig, model: ModelConfig) -> Catalog | None:
    """The durable catalog `config` names, checked against the base model; None for a RAM-only store."""
    backend: Backend
    if config.object_store is not None:
        from loraserve.adapter_store.s3 import S3Backend

        backend = S3Backend(config.object_store, config.object_store_endpoint)
    elif config.data_dir is not None:
        backend = DirectoryBackend(config.data_dir)
    else:
        return None
    catalog = Catalog(backend)
    try:
        catalog.check_model(model_identity(model))
    except BaseException:
        backend.close()
        raise
    return catalog


def _restore_and_preload(store: AdapterStore, config: StoreConfig) -> None:
    store.restore()
    for name, path in config.preload:
        try:
            store.preload(name, path)
        except LoraserveError as e:
            raise LoraserveError(f"preload {name}={path}: {e}") from None


async def _purge_periodically(store: AdapterStore, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        store.purge_expired()


async def serve(config: StoreConfig, stop_event: threading.Event) -> None:
    model = ModelConfig.from_dir(config.model_dir)
    catalog = open_catalog(config.persistence, model)
    try:
        await _serve(config, model, catalog, stop_event)
    finally:
        if catalog is not None:
            catalog.backend.close()


async def _serve(config: StoreConfig, model: ModelConfig, catalog: Catalog | None, stop_event: threading.Event) -> None:
    rows = RowsMaker(model, config.shm_root) if config.adapter_rows else None
    store = AdapterStore(model, config.limits, adapter_root=config.adapter_root, catalog=catalog, rows=rows)
    try:
        data_plane = DataPlane(store, config.data_address, config.keys)
    except BaseException:
        if rows is not None:
            rows.close()
        raise
    try:
        server, port = new_server(config.bind, server_interceptors(config.keys.token if config.keys else None))
    except BaseException:
        data_plane.stop()
        if rows is not None:
            rows.close()
        raise
    adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(AdapterStoreService(store, config.data_address), server)
    health = add_health_and_reflection(server, [SERVICE])
    await set_serving(health, [SERVICE], False)
    data_plane.start()
    await server.start()
    tasks = {"purge": _purge_periodically(store, config.purge_interval_s), "data plane": data_plane.watch()}
    try:
        await asyncio.to_thread(_restore_and_preload, store, config)
        await set_serving(health, [SERVICE], True)
        log.info(
            "adapter store: gRPC on %s (port %d), data plane on %s, %d adapter(s), budget %d MiB, root %s, kept in %s",
            config.bind,
            port,
            config.data_address,
            store.stats().adapters,
            config.limits.budget_bytes // MIB,
            config.adapter_root or "(none: RegisterFromPath refused)",
            catalog.location if catalog is not None else "RAM only",
        )
        await supervise("adapter store", tasks, stop_event, health_off(health, [SERVICE]))
        log.info("adapter store: stopping")
    finally:
        for coroutine in tasks.values():
            coroutine.close()  # never started when preloading failed; a no-op otherwise
        await set_serving(health, [SERVICE], False)
        await server.stop(grace=GRACE_S)
        data_plane.stop()
        if rows is not None:
            rows.close()  # its shared-memory files; workers' mappings stay valid


def main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except LoraserveError as e:
        log.error("adapter store: %s", e)
        return 1
    return run_service("adapter-store", args, lambda stop: serve(config, stop))
