"""`loraserve up`'s settings, and each role's command line made from them.

`up` has its own settings (`UpSettings`) and those of every role that are not the stack's to choose
(addresses, worker names, key and data directories): the engine's and the worker's, the store's,
the scheduler's, the gateway's, tracing. Each role's configuration is built from the same parsed
flags (`config_cli.config_from_args`, a flag shared by two roles sets both, e.g. --max-lora-rank
or --adapter-rows) with the stack's own values on top, and handed to the role as the flags that
rebuild it (`config_cli.config_to_argv`).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from loraserve.adapter_store.config import PersistenceConfig, StoreConfig, parse_preload, stack_data_dir
from loraserve.config_cli import add_config_arguments, config_from_args, config_to_argv, setting
from loraserve.gateway.settings import GatewaySettings
from loraserve.launcher.ports import Ports
from loraserve.model_config import ModelSettings
from loraserve.process import service_argv
from loraserve.scheduler.settings import POLICY_SKIP, SchedulerSettings, add_policy_arguments, policy_config
from loraserve.telemetry import TracingSettings
from loraserve.worker.cli import WORKER_ENGINE_DEFAULTS
from loraserve.worker.config import EngineConfig
from loraserve.worker.settings import WorkerSettings


@dataclass(frozen=True)
class UpSettings:
    """`up`'s own settings: the stack's shape, how it starts and is watched, and how `up` calls its gateway."""

    workers: int = setting(1, "number of worker processes")
    device: str = setting("cpu", "worker device: cpu, cuda, or cuda:0,cuda:1,... one per worker")
    base_port: int = setting(7100, "internal ports start here (5 consecutive ports)")
    adapter: tuple[str, ...] = setting((), "preload an adapter", metavar="NAME=PATH")
    internal_keys: str | None = setting(
        None,
        "the roles' internal keys (CURVE key pairs, internal gRPC token); made there if missing "
        "(default: DATA_DIR.internal-keys, beside the data dir)",
        metavar="DIR",
    )
    torch_threads: int | None = setting(None, "torch threads per CPU worker (default: spare cores / workers)")
    child_log_level: str = setting("WARNING", "log level of the roles")
    ready_timeout: float = setting(180.0, "seconds to wait for the stack to be healthy")
    restart: bool = setting(
        True,
        "restart a role that exits or stops answering health checks, with backoff (--no-restart: stop the stack)",
    )
    show_demo: bool = setting(False, "stream a few demo generations once up")
    exit_after_demo: bool = setting(False, "stop after --show-demo (for scripts)")
    metrics_port: int = setting(
        0, "Prometheus endpoints from this port on: gateway, scheduler, adapter store, then one per worker (0: off)"
    )
    tls_server_name: str = setting(
        "localhost", "a name --tls-cert is valid for: up's own calls to the gateway (health, demo) expect it"
    )
    tls_client_cert: Path | None = setting(
        None, "with --tls-client-ca: PEM client certificate (signed by that CA) for up's own calls to the gateway"
    )
    tls_client_key: Path | None = setting(None, "PEM private key of --tls-client-cert")


# The stack chooses these (addresses, names, directories), or another role's flag of the same name sets them.
_GATEWAY_SKIP = {"scheduler", "store", "token_address", "token_advertise", "max_lora_rank"}
_ENGINE_SKIP = {"device", "prefetch_depth"}  # --device is per worker; --prefetch-depth is the scheduler's too
_WORKER_SKIP = {"worker_id", "scheduler_address", "store_address", "drain_timeout", "torch_threads", "adapter_rows"}
_STORE_SKIP = {"bind", "data_address", "max_lora_rank", "preload", "shm_root"}
_SCHEDULER_SKIP = {"bind", "worker_address"}

_HELPS = {
    "model": "model directory (default: the demo model)",
    "bind": "the gateway's public gRPC address",
    "http_bind": "the gateway's OpenAI-compatible HTTP address (e.g. 127.0.0.1:8000); unset: off",
    "auth_file": "the gateway's tenants and API keys (TOML; see README)",
    "insecure_no_auth": "let the gateway serve a non-loopback --bind without --auth-file (something else guards "
    "the port)",
    "drain_timeout": "on SIGTERM, seconds the gateway and each worker let streams finish (the stack drains in order)",
    "adapter_rows": "the store keeps adapters packed in the workers' pool row layout and workers fetch those "
    "(--no-adapter-rows: workers fetch the files and parse, validate and pack them)",
    "shm_root": "where the store's rows live in shared memory, mapped by workers on this host; empty: sockets only",
    "data_dir": "the adapter store's data dir (default: one per stack: ~/.local/share/loraserve/stacks/PORT-MODELID)",
    "adapter_root": "directory RegisterAdapterFromPath may read from",
    "worker_timeout": "seconds before a silent worker is dropped (requests fail over)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`up`'s flags: its own, then each role's that the stack does not choose."""
    add_config_arguments(parser, ModelSettings, helps=_HELPS)
    add_config_arguments(parser, UpSettings)
    add_config_arguments(parser, GatewaySettings, skip=_GATEWAY_SKIP, helps=_HELPS)
    workers = parser.add_argument_group("workers (each worker's engine and fetches)")
    add_config_arguments(workers, EngineConfig, skip=_ENGINE_SKIP, defaults=WORKER_ENGINE_DEFAULTS)
    add_config_arguments(workers, WorkerSettings, skip=_WORKER_SKIP, helps=_HELPS)
    store = parser.add_argument_group("adapter store")
    add_config_arguments(store, StoreConfig, skip=_STORE_SKIP, helps=_HELPS)
    scheduler = parser.add_argument_group("scheduler")
    add_config_arguments(scheduler, SchedulerSettings, skip=_SCHEDULER_SKIP, helps=_HELPS)
    add_policy_arguments(scheduler)
    add_config_arguments(parser.add_argument_group("tracing"), TracingSettings)


def internal_keys_dir(args: argparse.Namespace) -> Path:
    """Where the stack's internal keys live (`supervisor` makes them when missing)."""
    if args.internal_keys:
        return Path(args.internal_keys)
    return store_data_dir(args).with_name(store_data_dir(args).name + ".internal-keys")  # beside it, not in it


def store_data_dir(args: argparse.Namespace) -> Path:
    """The store's data dir: --data-dir, else one per stack (base port and model)."""
    return Path(args.data_dir) if args.data_dir else stack_data_dir(args.base_port, args.model)


def metrics_ports(args: argparse.Namespace) -> dict[str, int]:
    """Each role's metrics port under `up --metrics-port P` (empty when it is 0)."""
    if not args.metrics_port:
        return {}
    roles = ["gateway", "scheduler", "adapter-store", *(f"worker-{i}" for i in range(args.workers))]
    return {role: args.metrics_port + i for i, role in enumerate(roles)}


def role_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The command line of every role, in start order: each role's configuration from `args` and the
    stack's own values (addresses, names, directories: always written), as the flags that rebuild it.
    Settings left at their default are not written: a role reads their environment twins itself."""
    ports = Ports(args.base_port)
    metrics = metrics_ports(args)
    service = {"internal_keys": str(internal_keys_dir(args))}

    def command(role: str, name: str, *configs: list[str]) -> list[str]:
        head = [sys.executable, "-m", "loraserve.cli", "--log-level", args.child_log_level, role]
        chosen = {**service, "metrics_port": metrics.get(name, 0)} if metrics else service
        return [*head, *(flag for config in configs for flag in config), *service_argv(args, **chosen)]

    model = _argv(ModelSettings, args, model=Path(args.model))
    persistence = config_from_args(PersistenceConfig, args)
    if persistence.object_store is None:
        persistence = replace(persistence, data_dir=store_data_dir(args))
    store = {
        "bind": ports.store,
        "data_address": ports.store_data,
        "preload": tuple(parse_preload(spec) for spec in args.adapter),
        "persistence": persistence,
    }
    scheduler = {"bind": ports.scheduler, "worker_address": ports.scheduler_workers}
    commands = {
        "adapter-store": command(
            "adapter-store", "adapter-store", model, _argv(StoreConfig, args, model_dir=Path(args.model), **store)
        ),
        "scheduler": command("scheduler", "scheduler", _argv(SchedulerSettings, args, **scheduler), _policy_argv(args)),
    }
    devices = args.device.split(",")
    profile = Path(args.runner_profile).resolve() if args.runner_profile is not None else None
    for i in range(args.workers):
        device = devices[i % len(devices)]
        engine = _argv(EngineConfig, args, WORKER_ENGINE_DEFAULTS, device=device, runner_profile=profile)
        worker = {
            "worker_id": f"worker-{i}",
            "scheduler_address": ports.scheduler_workers,
            "store_address": ports.store_data,
            "torch_threads": (args.torch_threads or _default_cpu_threads(args.workers)) if device == "cpu" else None,
        }
        commands[f"worker-{i}"] = command("worker", f"worker-{i}", model, engine, _argv(WorkerSettings, args, **worker))
    gateway = {"bind": args.bind, "scheduler": ports.scheduler, "store": ports.store, "token_address": ports.tokens}
    commands["gateway"] = command("gateway", "gateway", model, _argv(GatewaySettings, args, **gateway))
    return commands


def _argv(cls: type, args: argparse.Namespace, defaults: dict | None = None, **chosen: object) -> list[str]:
    """The flags of a `cls` configuration made from `up`'s parsed flags and the stack's `chosen` values:
    those, and every setting not at its default."""
    config = config_from_args(cls, args, **chosen)
    return config_to_argv(config, changed_only=True, always=set(chosen), defaults=defaults)


def _policy_argv(args: argparse.Namespace) -> list[str]:
    """The flags of the scheduler policy's settings that `up` was given away from their defaults."""
    config = policy_config(args)
    argv = config_to_argv(config.cluster, skip=POLICY_SKIP, changed_only=True)
    argv += config_to_argv(config.share, changed_only=True)
    return argv + config_to_argv(config.adaptive, skip=POLICY_SKIP, changed_only=True)


def _default_cpu_threads(workers: int) -> int:
    """Cores this process may use, less one for the other roles, shared by the CPU workers
    (oversubscribed torch threads spin and stall each other)."""
    return max(1, (len(os.sched_getaffinity(0)) - 1) // workers)
