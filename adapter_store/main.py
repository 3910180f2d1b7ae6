"""`loraserve adapter-store`: adapters in host RAM; gRPC control plane, ZMQ data plane.

Start-up: read the base model's config.json, open the data dir or object store (a clear error and
exit 1 if it cannot be locked or written), bind the data plane (its own thread, see data_plane.py),
start gRPC with health NOT_SERVING, restore every stored adapter (catalog.py; corrupt ones are
quarantined, ones over lowered limits skipped in place), register the preloads (a preload whose
files are unchanged keeps its version), then SERVING. Until then every gRPC call and every fetch
is refused UNAVAILABLE ("still loading its catalogue"): none is answered from a partial set. Stops on
SIGTERM/SIGINT: gRPC drains for a grace period, the data-plane thread closes its socket, exit 0.
If the data-plane thread or the purge task dies, health goes NOT_SERVING and the store exits 1
(`loraserve/supervise.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from loraserve.adapter_store.catalog import Catalog, model_identity
from loraserve.adapter_store.config import MIB, PersistenceConfig, StoreConfig, default_data_dir
from loraserve.adapter_store.data_plane import DataPlane
from loraserve.adapter_store.packing import RowsMaker
from loraserve.adapter_store.persistence import Backend, DirectoryBackend
from loraserve.adapter_store.service import AdapterStoreService
from loraserve.adapter_store.store import AdapterStore
from loraserve.config_cli import add_config_arguments, setting
from loraserve.config_cli import config_from_args as parse_config
from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.demo.model_settings import ModelSettings
from loraserve.errors import LoraserveError
from loraserve.grpc_token import server_interceptors
from loraserve.grpc_utils import add_health_and_reflection, new_server, set_serving
from loraserve.internal_auth import check_open_planes, load_optional
from loraserve.model_config import ModelConfig
from loraserve.process import add_service_arguments, run_service
from loraserve.supervise import health_off, supervise
from loraserve.v1 import adapter_store_pb2, adapter_store_pb2_grpc

log = logging.getLogger(__name__)
SERVICE = adapter_store_pb2.DESCRIPTOR.services_by_name["AdapterStore"].full_name
GRACE_S = 2.0


@dataclass(frozen=True)
class StoreCommand:
    """`loraserve adapter-store`'s settings beyond StoreConfig's (and the model's)."""

    preload_demo: bool | None = setting(
        None, "register every demo adapter (default: on when --model is the demo model)"
    )


MODEL_HELP = "base model directory (only config.json is read)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ModelSettings, helps={"model": MODEL_HELP})
    add_config_arguments(parser, StoreCommand)
    add_config_arguments(parser, StoreConfig, notes={"data_dir": str(default_data_dir())})
    add_service_arguments(parser)


def config_from_args(args: argparse.Namespace) -> StoreConfig:
    """The store's configuration from its flags: the demo adapters preloaded with the demo model (unless
    --no-preload-demo), the internal keys loaded, and persistence always durable (`persistence_from_cli`)."""
    parsed = parse_config(StoreConfig, args, model_dir=Path(args.model))
    preload = list(parsed.preload)
    preload_demo = args.preload_demo
    if preload_demo is None:
        preload_demo = Path(args.model).resolve() == DEMO_MODEL_DIR.resolve()
    if preload_demo:
        explicit = {name for name, _ in preload}
        preload = [(name, path) for name, path in demo_adapters().items() if name not in explicit] + preload
    keys = load_optional(args.internal_keys, "store")
    check_open_planes("store", keys, [parsed.bind, parsed.data_address], args.insecure_no_internal_auth)
    return replace(parsed, preload=tuple(preload), persistence=persistence_from_cli(parsed.persistence), keys=keys)


def persistence_from_cli(parsed: PersistenceConfig) -> PersistenceConfig:
    """The CLI is always durable: --object-store if given, else --data-dir or its default."""
    if parsed.object_store:
        if parsed.data_dir is not None:
            log.warning("--data-dir %s is ignored: adapters are kept in %s", parsed.data_dir, parsed.object_store)
        return replace(parsed, data_dir=None)
    return replace(parsed, data_dir=parsed.data_dir or default_data_dir())


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
    store = AdapterStore(  # `loading`: every caller is refused UNAVAILABLE until the catalogue is all in
        model, config.limits, adapter_root=config.adapter_root, catalog=catalog, rows=rows, loading=True
    )
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
        store.loaded()
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
