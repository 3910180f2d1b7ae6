"""`loraserve up`: the whole stack as local processes on loopback.

Starts the adapter store, the scheduler, N workers and the gateway as child processes (each dies
with the launcher), waits until every role reports healthy, prints the gateway's address, and
stops them all on Ctrl-C or SIGTERM. Meanwhile a role that exits or stops answering its health
check is restarted with backoff (`loraserve/supervisor.py`); only a crash loop stops the stack.
With the demo model (the default) the store preloads every demo adapter; `--show-demo` then
streams a few generations through the public API.

With `--tls-cert`/`--tls-key` (and `--tls-client-ca`) the gateway serves TLS (mutual TLS), and
`up`'s own health checks of the gateway go over that same TLS port, trusting exactly the gateway's
certificate and expecting the name `--tls-server-name` in it; under mutual TLS they present
`--tls-client-cert`/`--tls-client-key`, which `up` therefore requires (`gateway/tls.py`).
`--show-demo` calls the gateway the same way.

`--http-bind` turns on the gateway's OpenAI-compatible HTTP API (`gateway/http/`); with
`--show-demo` (`make run`) `up` then prints a curl and an openai-client example of it.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from loraserve import internal_auth, telemetry
from loraserve.adapter_store.config import stack_data_dir
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import InvalidConfigError, InvalidModelError
from loraserve.gateway.bind_rule import check_bind
from loraserve.gateway.tls import ClientTls, add_tls_arguments, load_server_tls, load_up_client_tls
from loraserve.gateway.tool_parsers import add_tool_parser_argument
from loraserve.process import add_drain_argument, become_service
from loraserve.scheduler.policy import POLICIES
from loraserve.supervisor import CrashLoop, Role, SupervisionConfig, Supervisor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ports:
    """Every address of a local stack, derived from one base port."""

    base: int

    @property
    def scheduler(self) -> str:
        return f"127.0.0.1:{self.base}"

    @property
    def scheduler_workers(self) -> str:
        return f"tcp://127.0.0.1:{self.base + 1}"

    @property
    def store(self) -> str:
        return f"127.0.0.1:{self.base + 2}"

    @property
    def store_data(self) -> str:
        return f"tcp://127.0.0.1:{self.base + 3}"

    @property
    def tokens(self) -> str:
        return f"tcp://127.0.0.1:{self.base + 4}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="model directory (default: the demo model)")
    parser.add_argument("--workers", type=int, default=1, help="number of worker processes")
    parser.add_argument("--device", default="cpu", help="worker device: cpu, cuda, or cuda:0,cuda:1,... one per worker")
    parser.add_argument("--bind", default="127.0.0.1:50051", help="the gateway's public gRPC address")
    parser.add_argument(
        "--http-bind",
        default=None,
        help="the gateway's OpenAI-compatible HTTP address (e.g. 127.0.0.1:8000); unset: off",
    )
    add_tool_parser_argument(parser)
    parser.add_argument(
        "--auth-file", type=Path, default=None, help="the gateway's tenants and API keys (TOML; see README)"
    )
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="let the gateway serve a non-loopback --bind without --auth-file (something else guards the port)",
    )
    add_tls_arguments(parser)
    add_up_tls_arguments(parser)
    parser.add_argument("--base-port", type=int, default=7100, help="internal ports start here (5 consecutive ports)")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH", help="preload an adapter")
    parser.add_argument("--adapter-root", default=None, help="directory RegisterAdapterFromPath may read from")
    parser.add_argument(
        "--data-dir",
        default=None,
        help="the adapter store's data dir (default: one per stack: ~/.local/share/loraserve/stacks/PORT-MODELID)",
    )
    parser.add_argument(
        "--internal-keys",
        default=None,
        metavar="DIR",
        help="the roles' internal keys (CURVE key pairs, internal gRPC token); made there if missing "
        "(default: DATA_DIR.internal-keys, beside the data dir)",
    )
    parser.add_argument("--pool-pages", type=int, default=None, help="pages of each worker's unified pool")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument(
        "--enforce-eager", action="store_true", help="workers run every step eagerly, with no CUDA graphs"
    )
    parser.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="workers keep KV pages for later requests with the same prefix (--no-prefix-cache: off)",
    )
    parser.add_argument(
        "--prefetch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="workers copy the adapters the scheduler predicts into their pool ahead of need (--no-prefetch: off)",
    )
    parser.add_argument(
        "--runner",
        choices=("real", "emulated"),
        default="real",
        help="workers' runner: real (the model) or emulated (a benchmark and test tool, never for serving: "
        "no weights, steps wait what --runner-profile predicts, deterministic tokens; dozens fit on one machine)",
    )
    parser.add_argument(
        "--runner-profile",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --runner emulated: `loraserve bench --suite runner-profile`'s runner_profile.json",
    )
    parser.add_argument(
        "--adapter-rows",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the store keeps adapters packed in the workers' pool row layout and workers fetch those "
        "(--no-adapter-rows: workers fetch the files and parse, validate and pack them)",
    )
    parser.add_argument(
        "--shared-memory-root",
        default="/dev/shm",
        metavar="DIR",
        help="where the store's rows live in shared memory, mapped by workers on this host; empty: sockets only",
    )
    parser.add_argument(
        "--adapter-cache-gb",
        type=float,
        default=None,
        help="host RAM for adapters on each worker, GiB (default: the worker's own default)",
    )
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="torch threads per CPU worker (default: spare cores / workers)"
    )
    parser.add_argument(
        "--worker-timeout",
        type=float,
        default=1.5,
        help="seconds before a silent worker is dropped (requests fail over)",
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default=None,
        help="the scheduler's scheduling policy (adaptive or fcfs; default: the scheduler's, adaptive)",
    )
    add_drain_argument(parser, "the gateway and each worker let streams finish (the stack drains in order)")
    parser.add_argument("--child-log-level", default="WARNING", help="log level of the roles")
    parser.add_argument(
        "--ready-timeout", type=float, default=180.0, help="seconds to wait for the stack to be healthy"
    )
    parser.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="restart a role that exits or stops answering health checks, with backoff (--no-restart: stop the stack)",
    )
    parser.add_argument("--show-demo", action="store_true", help="stream a few demo generations once up")
    parser.add_argument("--exit-after-demo", action="store_true", help="stop after --show-demo (for scripts)")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus endpoints from this port on: gateway, scheduler, adapter store, then one per worker (0: off)",
    )
    telemetry.add_tracing_arguments(parser)


def add_up_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """How `up` itself calls a TLS gateway (its health checks and --show-demo)."""
    parser.add_argument(
        "--tls-server-name",
        default="localhost",
        help="a name --tls-cert is valid for: up's own calls to the gateway (health, demo) expect it",
    )
    parser.add_argument(
        "--tls-client-cert",
        type=Path,
        default=None,
        help="with --tls-client-ca: PEM client certificate (signed by that CA) for up's own calls to the gateway",
    )
    parser.add_argument("--tls-client-key", type=Path, default=None, help="PEM private key of --tls-client-cert")


def gateway_tls(args: argparse.Namespace) -> ClientTls | None:
    """How `up` reaches its gateway over TLS (None: plaintext); InvalidConfigError naming a bad flag."""
    server = load_server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
    if server is None:
        if args.tls_client_cert is not None or args.tls_client_key is not None:
            raise InvalidConfigError("--tls-client-cert and --tls-client-key are for a --tls-client-ca gateway")
        return None
    return load_up_client_tls(server, args.tls_server_name, args.tls_client_cert, args.tls_client_key)


def metrics_ports(args: argparse.Namespace) -> dict[str, int]:
    """Each role's metrics port under `up --metrics-port P` (empty when it is 0)."""
    if not args.metrics_port:
        return {}
    roles = ["gateway", "scheduler", "adapter-store", *(f"worker-{i}" for i in range(args.workers))]
    return {role: args.metrics_port + i for i, role in enumerate(roles)}


def _flags(**values: object) -> list[str]:
    """`--some-flag VALUE` pairs for every value that is not None (underscores become dashes)."""
    pairs = [(f"--{name.replace('_', '-')}", str(value)) for name, value in values.items() if value is not None]
    return [item for pair in pairs for item in pair]


def internal_keys_dir(args: argparse.Namespace) -> Path:
    """Where the stack's internal keys live (`supervisor` makes them when missing)."""
    if args.internal_keys:
        return Path(args.internal_keys)
    data_dir = Path(args.data_dir or stack_data_dir(args.base_port, args.model))
    return data_dir.with_name(data_dir.name + ".internal-keys")  # beside the store's data, not in it


def role_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The command line of every role, in start order."""
    ports = Ports(args.base_port)
    base = [sys.executable, "-m", "loraserve.cli", "--log-level", args.child_log_level]
    # every role: tracing, and the keys of the authenticated internal planes
    common = _flags(
        trace_exporter=args.trace_exporter, otlp_endpoint=args.otlp_endpoint, internal_keys=internal_keys_dir(args)
    )
    preloads = [item for spec in args.adapter for item in ("--preload", spec)]
    data_dir = args.data_dir or stack_data_dir(args.base_port, args.model)
    commands = {
        "adapter-store": [
            *base,
            "adapter-store",
            *_flags(model=args.model, bind=ports.store, data_address=ports.store_data, adapter_root=args.adapter_root),
            *_flags(data_dir=data_dir, shared_memory_root=args.shared_memory_root),
            *([] if args.adapter_rows else ["--no-adapter-rows"]),
            *preloads,
            *common,
        ],
        "scheduler": [
            *base,
            "scheduler",
            *_flags(bind=ports.scheduler, worker_address=ports.scheduler_workers, worker_timeout=args.worker_timeout),
            *_flags(policy=args.policy),
            *common,
        ],
    }
    devices = args.device.split(",")
    for i in range(args.workers):
        device = devices[i % len(devices)]
        threads = (args.torch_threads or _default_cpu_threads(args.workers)) if device == "cpu" else None
        commands[f"worker-{i}"] = [
            *base,
            "worker",
            *_flags(model=args.model, worker_id=f"worker-{i}", device=device),
            *_flags(scheduler_address=ports.scheduler_workers, store_address=ports.store_data),
            *_flags(max_batch_size=args.max_batch_size, drain_timeout=args.drain_timeout, pool_pages=args.pool_pages),
            *_flags(adapter_cache_gb=args.adapter_cache_gb, torch_threads=threads),
            *(["--enforce-eager"] if args.enforce_eager else []),
            *([] if args.prefix_cache else ["--no-prefix-cache"]),
            *([] if args.prefetch else ["--no-prefetch"]),
            *([] if args.adapter_rows else ["--no-adapter-rows"]),
            *_flags(shared_memory_root=args.shared_memory_root),
            *_runner_flags(args),
            *common,
        ]
    commands["gateway"] = [
        *base,
        "gateway",
        *_flags(model=args.model, bind=args.bind, scheduler=ports.scheduler, store=ports.store),
        *_flags(http_bind=args.http_bind, tool_call_parser=args.tool_call_parser),
        *_flags(token_address=ports.tokens, drain_timeout=args.drain_timeout, auth_file=args.auth_file),
        *(["--insecure-no-auth"] if args.insecure_no_auth else []),
        *_flags(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca),
        *common,
    ]
    for role, port in metrics_ports(args).items():
        commands[role] += ["--metrics-port", str(port)]
    return commands


def _runner_flags(args: argparse.Namespace) -> list[str]:
    """A worker's runner flags (none for the real runner)."""
    if args.runner == "real":
        return []
    profile = [] if args.runner_profile is None else ["--runner-profile", str(Path(args.runner_profile).resolve())]
    return ["--runner", args.runner, *profile]


def check_runner(args: argparse.Namespace) -> None:
    """Before any worker starts: an emulated runner's profile exists, parses and fits the model
    (InvalidConfigError saying what to do), rather than every worker failing in a restart loop."""
    if args.runner != "emulated":
        return
    from loraserve.model_config import ModelConfig
    from loraserve.worker.runner_profile import HOW_TO_WRITE, load_profile

    if args.runner_profile is None:
        raise InvalidConfigError(f"--runner emulated needs --runner-profile FILE: {HOW_TO_WRITE}")
    if any(device not in ("cpu", "auto") for device in args.device.split(",")):
        raise InvalidConfigError(f"--runner emulated runs on the CPU: --device {args.device} is not for it")
    try:
        model = ModelConfig.from_dir(args.model)
    except InvalidModelError as e:
        raise InvalidConfigError(f"--model {args.model}: {e}") from None
    load_profile(Path(args.runner_profile), model)


def supervisor(args: argparse.Namespace, tls: ClientTls | None) -> Supervisor:
    """Every role of the stack (in start order) under one Supervisor; roles with a gRPC server are
    health-checked (the gateway through `tls` when it serves TLS: `gateway_tls(args)`). Checks an
    emulated runner's profile first (`check_runner`)."""
    check_runner(args)
    ports = Ports(args.base_port)
    internal_auth.generate(internal_keys_dir(args))
    health = {"adapter-store": ports.store, "scheduler": ports.scheduler, "gateway": args.bind}
    stop_groups = {"gateway": 0, "scheduler": 2, "adapter-store": 3}  # workers: 1
    channels = {"gateway": tls.channel} if tls is not None else {}
    roles = [
        Role(name, command, health.get(name), stop_groups.get(name, 1), channels.get(name, grpc.insecure_channel))
        for name, command in role_commands(args).items()
    ]
    return Supervisor(roles, SupervisionConfig(startup_grace_s=args.ready_timeout))


def wait_healthy(addresses: list[str], stack: Supervisor, timeout_s: float, restart: bool = False) -> None:
    """Until every gRPC health service at `addresses` (the stack's roles') says SERVING; raises if time
    runs out (naming the last failure: a TLS handshake error shows there). A child that dies meanwhile
    is restarted under `restart` (the supervisor's backoff; a crash loop raises CrashLoop), and is an
    error otherwise."""
    deadline = time.monotonic() + timeout_s
    roles = {role.health_address: role for role in stack.roles.values() if role.health_address}
    pending = [roles.get(address) or Role(address, [], address) for address in addresses]
    last_error = ""
    while pending:
        if restart:
            stack.tick()
        elif stack.dead():
            raise RuntimeError(f"a role exited during start-up: {', '.join(stack.dead())}")
        if time.monotonic() > deadline:
            names = ", ".join(f"{r.name} ({r.health_address})" for r in pending)
            raise RuntimeError(f"not healthy after {timeout_s:.0f} s: {names}{last_error}")
        try:
            status = pending[0].check_health()
        except grpc.RpcError as e:
            status, last_error = None, f"; last error: {e.code().name}: {e.details()}"
        if status == health_pb2.HealthCheckResponse.SERVING:
            pending.pop(0)
            last_error = ""
        else:
            time.sleep(0.2)


def _demo_client_options(tls: ClientTls | None) -> dict[str, object]:
    """`loraserve.client.Client` options for `up`'s own demo calls to its gateway."""
    if tls is None:
        return {}
    return {
        "root_certificates": tls.roots,
        "private_key": tls.private_key,
        "certificate_chain": tls.cert_chain,
        "channel_options": tls.channel_options(),
    }


def _security(args: argparse.Namespace) -> str:
    return "" if args.tls_cert is None else " (mutual TLS)" if args.tls_client_ca else " (TLS)"


def _model_label(model: Path) -> str:
    return "the embedded demo model" if model.resolve() == DEMO_MODEL_DIR.resolve() else f"model {model}"


def _default_cpu_threads(workers: int) -> int:
    """Cores this process may use, less one for the other roles, shared by the CPU workers
    (oversubscribed torch threads spin and stall each other)."""
    return max(1, (len(os.sched_getaffinity(0)) - 1) // workers)


def free_port_block(size: int) -> int:
    """A base port with `size` consecutive free ports on loopback (best effort: they may be taken later)."""
    import socket

    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + size >= 65000:
            continue
        taken: list[socket.socket] = []
        try:
            for port in range(base, base + size):
                taken.append(socket.socket())
                taken[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in taken:
                s.close()
    raise RuntimeError("no block of free ports on 127.0.0.1")


class LocalStack:
    """A stack on free loopback ports, with handles to every process (tests and benchmarks use it)."""

    def __init__(self, model: Path, workers: int = 1, **options):
        base = free_port_block(6)  # one block, so the gateway's port cannot land among the others
        self.ports = Ports(base)
        self.address = f"127.0.0.1:{base + 5}"
        parser = argparse.ArgumentParser()  # plain: `up`'s defaults, without its environment twins
        add_arguments(parser)
        args = parser.parse_args(
            ["--model", str(model), "--workers", str(workers), "--bind", self.address, "--base-port", str(base)]
        )
        unknown = set(options) - set(vars(args))
        if unknown:
            raise TypeError(f"unknown stack options {sorted(unknown)}")
        vars(args).update(options)
        self.stack = supervisor(args, gateway_tls(args))  # nothing calls its tick(): a test's killed role stays dead
        self.internal_keys = internal_keys_dir(args)
        self.internal_token = internal_auth.load(self.internal_keys, "gateway").token  # to call internal ports

    def start(self, timeout_s: float = 180.0) -> LocalStack:
        self.stack.start()
        try:
            wait_healthy([self.ports.store, self.ports.scheduler, self.address], self.stack, timeout_s)
        except Exception:
            self.stop()
            raise
        return self

    def process(self, name: str) -> subprocess.Popen:
        return self.stack.children[name]

    def stop(self) -> None:
        self.stack.stop(timeout_s=10.0)


def main(args: argparse.Namespace) -> int:
    try:  # before starting anything
        check_bind(args.bind, args.auth_file, args.insecure_no_auth)
        if args.http_bind:
            check_bind(args.http_bind, args.auth_file, args.insecure_no_auth)
        tls = gateway_tls(args)  # reads and checks the TLS files
        stack = supervisor(args, tls)
    except InvalidConfigError as e:
        log.error("%s", e)
        return 1
    stop = become_service("up")
    ports = Ports(args.base_port)
    started = time.monotonic()
    stack.start()
    try:
        wait_healthy([ports.store, ports.scheduler, args.bind], stack, args.ready_timeout, args.restart)
        print(
            f"loraserve is up in {time.monotonic() - started:.1f} s: gRPC API on {args.bind}{_security(args)} "
            f"({args.workers} worker(s), {_model_label(args.model)}); Ctrl-C stops it",
            flush=True,
        )
        if args.http_bind:
            scheme = "http" if tls is None else "https"
            print(f"OpenAI-compatible HTTP API on {scheme}://{args.http_bind}/v1", flush=True)
        if args.metrics_port:
            endpoints = ", ".join(f"{role} :{port}" for role, port in metrics_ports(args).items())
            print(f"Prometheus metrics at http://127.0.0.1:PORT/metrics: {endpoints}", flush=True)
        if args.show_demo:
            from loraserve.demo.client import show_demo

            show_demo(args.bind, **_demo_client_options(tls))
            if args.exit_after_demo:
                return 0
            if args.http_bind and tls is None:
                print(HOW_TO_CALL_HTTP.format(address=args.http_bind, model=Path(args.model).name), flush=True)
            print(HOW_TO_CALL.format(address=args.bind) if tls is None else HOW_TO_CALL_TLS, flush=True)
        while not stop.is_set():
            if args.restart:
                stack.tick()
            elif stack.dead():
                log.error("a role exited: %s; stopping the stack", ", ".join(stack.dead()))
                return 1
            stop.wait(0.5)
        return 0
    except CrashLoop as e:
        log.error("%s; stopping the stack", e)
        return 1
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    finally:
        stack.stop(timeout_s=args.drain_timeout + 5.0)


HOW_TO_CALL = """
The stack keeps serving. Call it from Python:

    from loraserve.client import Client
    with Client("{address}") as client:
        print(client.generate("the quiet king", adapter="upper").text)

or with grpcurl (server reflection is on):

    grpcurl -plaintext -d '{{"adapter": "rot13", "text": "the quiet king"}}' \\
        {address} loraserve.v1.LoraServe/GenerateStream

Ctrl-C stops every process.
"""

HOW_TO_CALL_HTTP = """
The OpenAI-compatible HTTP API (models: the base model '{model}' and every adapter) with curl:

    curl http://{address}/v1/completions -H 'Content-Type: application/json' \\
        -d '{{"model": "upper", "prompt": "the quiet king", "max_tokens": 24, "temperature": 0}}'

or with the openai Python client (pip install openai):

    from openai import OpenAI
    client = OpenAI(base_url="http://{address}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="rot13", messages=[{{"role": "user", "content": "the quiet king"}}], temperature=0
    )
    print(reply.choices[0].message.content)
"""

HOW_TO_CALL_TLS = """
The stack keeps serving, over TLS: README's "TLS" shows a Python client and grpcurl with -cacert.
Ctrl-C stops every process.
"""
