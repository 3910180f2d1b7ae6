"""`loraserve up`'s settings, and each role's command line made from them.

`up` has its own settings (`UpSettings`) and those of every role (`ROLES`: each role's configuration,
less what the stack chooses itself: addresses, worker names and devices, the store's preloads), with
their help as the roles give it. A setting two roles have (--max-lora-rank, --adapter-rows,
--drain-timeout, ...) is one flag that sets both (`config_cli.add_roles_arguments`). Each role's
configuration is built from the parsed flags (`config_cli.config_from_args`) with the stack's own values
on top, and handed to the role as the flags that rebuild it (`config_cli.config_to_argv`).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from loraserve.adapter_store.config import PersistenceConfig, StoreConfig, parse_preload, stack_data_dir
from loraserve.config_cli import (
    RoleFlags,
    add_config_arguments,
    add_roles_arguments,
    config_from_args,
    config_to_argv,
    setting,
)
from loraserve.demo.model_settings import ModelSettings
from loraserve.gateway.config import GatewayConfig
from loraserve.launcher.ports import Ports
from loraserve.metrics import METRICS_OFF
from loraserve.process import service_argv
from loraserve.scheduler.config import SchedulerConfig
from loraserve.telemetry import TracingSettings
from loraserve.worker.cli import WORKER_ENGINE_DEFAULTS
from loraserve.worker.config import EngineConfig, WorkerConfig


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
        METRICS_OFF,
        "Prometheus endpoints from this port on: gateway, scheduler, adapter store, then one per worker (0: off)",
    )
    tls_server_name: str = setting(
        "localhost", "a name --tls-cert is valid for: up's own calls to the gateway (health, demo) expect it"
    )
    tls_client_cert: Path | None = setting(
        None, "with --tls-client-ca: PEM client certificate (signed by that CA) for up's own calls to the gateway"
    )
    tls_client_key: Path | None = setting(None, "PEM private key of --tls-client-cert")


# Each role's configurations, less the settings the stack chooses (`role_commands` sets them).
ROLES = {
    "gateway": RoleFlags(
        "gateway", (GatewayConfig,), frozenset({"scheduler", "store", "token_address", "token_advertise"})
    ),
    "worker": RoleFlags(
        "workers",
        (EngineConfig, WorkerConfig),
        frozenset({"device", "worker_id", "scheduler_address", "store_address", "torch_threads"}),
        defaults=WORKER_ENGINE_DEFAULTS,
        description="each worker's engine and fetches",
    ),
    "adapter-store": RoleFlags(
        "adapter store",
        (StoreConfig,),
        frozenset({"bind", "data_address", "preload"}),
        notes={"data_dir": "one per stack: ~/.local/share/loraserve/stacks/PORT-MODELID"},
    ),
    "scheduler": RoleFlags("scheduler", (SchedulerConfig,), frozenset({"bind", "worker_address"})),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`up`'s flags: its own, then each role's that the stack does not choose."""
    add_config_arguments(parser, ModelSettings)
    add_config_arguments(parser, UpSettings)
    add_roles_arguments(parser, list(ROLES.values()))
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
        "scheduler": command("scheduler", "scheduler", _argv(SchedulerConfig, args, **scheduler)),
    }
    devices = args.device.split(",")
    profile = Path(args.runner_profile).resolve() if args.runner_profile is not None else None
    for i in range(args.workers):
        device = devices[i % len(devices)]
        engine = _argv(EngineConfig, args, ROLES["worker"].defaults, device=device, runner_profile=profile)
        worker = {
            "worker_id": f"worker-{i}",
            "scheduler_address": ports.scheduler_workers,
            "store_address": ports.store_data,
            "torch_threads": (args.torch_threads or _default_cpu_threads(args.workers)) if device == "cpu" else None,
        }
        commands[f"worker-{i}"] = command("worker", f"worker-{i}", model, engine, _argv(WorkerConfig, args, **worker))
    gateway = {"bind": args.bind, "scheduler": ports.scheduler, "store": ports.store, "token_address": ports.tokens}
    commands["gateway"] = command("gateway", "gateway", model, _argv(GatewayConfig, args, **gateway))
    return commands


def _argv(cls: type, args: argparse.Namespace, defaults: dict | None = None, **chosen: object) -> list[str]:
    """The flags of a `cls` configuration made from `up`'s parsed flags and the stack's `chosen` values:
    those, and every setting not at its default."""
    config = config_from_args(cls, args, **chosen)
    return config_to_argv(config, changed_only=True, always=set(chosen), defaults=defaults)


def _default_cpu_threads(workers: int) -> int:
    """Cores this process may use, less one for the other roles, shared by the CPU workers
    (oversubscribed torch threads spin and stall each other)."""
    return max(1, (len(os.sched_getaffinity(0)) - 1) // workers)
