"""`loraserve gateway`: the public gRPC API.

Stopping (SIGTERM) drains: health goes NOT_SERVING and every new call gets UNAVAILABLE at once,
while the streams in flight finish (up to `--drain-timeout`); then the server stops.

`--auth-file` turns on tenants and API keys (`gateway/tenants.py`); SIGHUP reloads the file without
dropping a call (a file that fails its checks keeps the old keys, and says why in the log). Without
it the gateway is open, and binds loopback only unless `--insecure-no-auth` (`gateway/bind_rule.py`).

`--tls-cert`/`--tls-key` serve the public port (health and reflection included) over TLS, and
`--tls-client-ca` makes it mutual TLS (`gateway/tls.py`); TLS does not replace the auth file.

`--http-bind` also serves the OpenAI-compatible HTTP API (`gateway/http/`) from this process: same
keys, same bind rule, same TLS files, same drain.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from dataclasses import replace
from pathlib import Path

import grpc

from loraserve.config_cli import add_config_arguments, config_from_args
from loraserve.demo.model_settings import ModelSettings
from loraserve.errors import InvalidConfigError
from loraserve.gateway.adapter_versions import AdapterVersions, watch_store
from loraserve.gateway.admin_service import AdapterAdminService
from loraserve.gateway.audit import audited
from loraserve.gateway.auth import Authenticator
from loraserve.gateway.bind_rule import check_bind
from loraserve.gateway.config import MODEL_HELP, GatewayConfig
from loraserve.gateway.constraints import ConstraintSandbox, TokenizerSpec
from loraserve.gateway.core import GenerationCore
from loraserve.gateway.gate import Gate
from loraserve.gateway.grpc_calls import add_loraserve
from loraserve.gateway.model_service import ModelService
from loraserve.gateway.scheduler_client import SchedulerClient
from loraserve.gateway.service import GenerationService
from loraserve.gateway.store_client import StoreClient
from loraserve.gateway.tenant_adapters import TenantAdapters
from loraserve.gateway.tenants import load_auth_file
from loraserve.gateway.tls import load_server_tls
from loraserve.gateway.token_sink import TokenSink
from loraserve.gateway.tokenizing import Tokenizing
from loraserve.gateway.tool_parsers import parser_named
from loraserve.gateway.validation import Limits
from loraserve.grpc_utils import add_health_and_reflection, internal_channel, new_server, set_serving
from loraserve.internal_auth import InternalAuthSettings, check_open_planes, load_optional
from loraserve.model_config import ModelConfig
from loraserve.process import add_service_arguments, run_service
from loraserve.supervise import health_off, supervise
from loraserve.tokenizer import Tokenizer
from loraserve.v1 import adapter_store_pb2_grpc, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)
SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["LoraServe"].full_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ModelSettings, helps={"model": MODEL_HELP})
    add_config_arguments(parser, GatewayConfig)
    add_service_arguments(parser)


def _reload_keys(auth: Authenticator, path: Path | None) -> None:
    """SIGHUP: read the auth file again; a file that fails its checks leaves the current keys in place."""
    if path is None:
        log.warning("SIGHUP: no --auth-file to reload; the gateway stays open")
        return
    try:
        with audited("reload_keys") as record:
            record.tenant = "operator"
            config = load_auth_file(path)
            auth.reload(config)
        log.info("SIGHUP: reloaded %s: %d tenants", path, len(config.tenants))
    except InvalidConfigError as e:
        log.error("SIGHUP: keeping the current keys: %s", e)


async def _watch_cluster(core: GenerationCore, scheduler, health, period_s: float = 0.25) -> None:
    """Ask the scheduler for the cluster's state a few times a second: SERVING only while a worker is
    ready (and the gateway is not draining); the answer also drives failover (`Streams.on_cluster`)."""
    serving = None
    while True:
        asked_at = time.monotonic()
        try:
            state = await scheduler.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=1.0)
        except grpc.aio.AioRpcError:
            state = None
            core.streams.on_scheduler_unreachable(asked_at)
        if state is not None:
            ready = sum(1 for w in state.workers if w.ready and not w.draining)
            core.streams.on_cluster(state.instance, {w.worker_id for w in state.workers}, ready > 0, asked_at)
        else:
            ready = 0
        core.ready_workers = ready
        if (ready > 0 and not core.gate.draining) != serving:
            serving = ready > 0 and not core.gate.draining
            await set_serving(health, [SERVICE], serving)
            log.info("gateway health: %s (%d ready workers)", "SERVING" if serving else "NOT_SERVING", ready)
        await asyncio.sleep(period_s)


async def _drain_on_stop(core: GenerationCore, health, stop_event, drained: asyncio.Event, timeout_s: float):
    """On the stop signal: NOT_SERVING, refuse new calls, wait for the streams in flight, then set `drained`."""
    while not stop_event.is_set():
        await asyncio.sleep(0.1)
    core.gate.drain()
    await set_serving(health, [SERVICE], False)
    log.info("gateway draining: %d streams in flight (up to %.0f s)", len(core.streams), timeout_s)
    deadline = time.monotonic() + timeout_s
    while len(core.streams) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    if len(core.streams):
        log.warning("gateway: %d streams still in flight at the drain timeout; stopping", len(core.streams))
    drained.set()
    await asyncio.Event().wait()  # a supervised task must not end: the role stops on `drained`


async def serve(args: argparse.Namespace, stop_event) -> None:
    model_dir = config_from_args(ModelSettings, args).model
    internal = config_from_args(InternalAuthSettings, args)
    config = config_from_args(GatewayConfig, args)
    check_bind(config.bind, config.auth_file, config.insecure_no_auth)
    if config.http_bind:
        check_bind(config.http_bind, config.auth_file, config.insecure_no_auth)
    tls = load_server_tls(config.tls.tls_cert, config.tls.tls_key, config.tls.tls_client_ca)
    logging.getLogger("loraserve.audit").setLevel(logging.INFO)  # the audit trail shows at any --log-level
    auth = Authenticator(load_auth_file(config.auth_file) if config.auth_file is not None else None)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, _reload_keys, auth, config.auth_file)
    model = ModelConfig.from_dir(model_dir)
    config = replace(config, model_name=Path(model_dir).name, model_type=model.model_type)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    limits = Limits(
        vocab_size=model.vocab_size,
        max_context=config.max_context or model.max_position_embeddings,
        default_max_new_tokens=config.default_max_new_tokens,
    )
    keys = load_optional(internal.internal_keys, "gateway")
    check_open_planes("gateway", keys, [config.token_address], internal.insecure_no_internal_auth)
    token = keys.token if keys is not None else None
    sink = TokenSink(config.token_address, keys)
    if config.token_advertise:
        sink.address = config.token_advertise
    scheduler = scheduler_pb2_grpc.SchedulerStub(internal_channel(config.scheduler, token))
    store_stub = adapter_store_pb2_grpc.AdapterStoreStub(internal_channel(config.store, token))
    gate = Gate(auth)
    store = StoreClient(store_stub, config.internal_timeout_s)
    versions = AdapterVersions()  # kept by the store's Watch
    adapters = TenantAdapters(store.ask, versions)  # names as each tenant sees them
    scheduler_client = SchedulerClient(scheduler, sink.address, config.internal_timeout_s)
    tokenizing = Tokenizing(tokenizer, limits.max_context, config.tokenizing)  # the one pool, off the loop
    constraints = ConstraintSandbox(  # structured output is compiled in these child processes only
        TokenizerSpec(tokenizer.to_json(), limits.vocab_size, tokenizer.eos_token_ids), config.constraints
    )
    await constraints.start()
    core = GenerationCore(config, limits, tokenizer, sink, scheduler_client, adapters, gate, tokenizing, constraints)
    admin = AdapterAdminService(gate, store, adapters, versions, config.upload_timeout_s)
    # the HTTP socket first: a busy port stops here
    http = _http_server(config, model_dir, core, admin, tls) if config.http_bind else None
    server, port = new_server(config.bind, credentials=tls.credentials() if tls else None)
    add_loraserve(server, GenerationService(core), ModelService(core), admin)
    health = add_health_and_reflection(server, [SERVICE])
    await set_serving(health, [SERVICE], False)
    await server.start()
    security = "plaintext" if tls is None else "mutual TLS" if tls.mutual else "TLS"
    log.info("gateway: gRPC (%s) on %s (port %d), token sink %s", security, config.bind, port, sink.address)
    if auth.open:
        log.warning("gateway: no --auth-file: every caller is tenant 'default' with every scope")
    else:
        log.info("gateway: API keys of %d tenants from %s (SIGHUP reloads)", len(auth.tenants), config.auth_file)
    drained = asyncio.Event()
    tasks = {
        "token sink": sink.run(),
        "cluster watch": _watch_cluster(core, scheduler, health),
        "drain": _drain_on_stop(core, health, stop_event, drained, config.drain_timeout_s),
        "adapter versions": watch_store(store_stub, versions),
    }
    if http is not None:
        tasks["http"] = http.run()
    try:
        await supervise("gateway", tasks, drained, health_off(health, [SERVICE]))
    finally:
        await server.stop(grace=2.0)
        await scheduler_client.close()
        sink.shutdown()
        tokenizing.close()
        await constraints.close()


def _http_server(config: GatewayConfig, model_dir: Path, core: GenerationCore, admin: AdapterAdminService, tls):
    """The OpenAI-compatible HTTP API on --http-bind (imported only then: FastAPI is not light)."""
    from loraserve.gateway.http.server import HttpServer

    tool_parser = parser_named(config.tool_call_parser) if config.tool_call_parser else None
    http = HttpServer(
        core,
        admin,
        model_dir,
        config.http_bind,
        config.tls.tls_cert,
        config.tls.tls_key,
        config.tls.tls_client_ca,
        limits=config.http,
        tool_parser=tool_parser,
    )
    security = "HTTP" if tls is None else "HTTPS, mutual TLS" if tls.mutual else "HTTPS"
    log.info("gateway: OpenAI-compatible API (%s) on %s (port %d)", security, config.http_bind, http.port)
    return http


def main(args: argparse.Namespace) -> int:
    return run_service("gateway", args, lambda stop: serve(args, stop))
