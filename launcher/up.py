"""`loraserve up`: the whole stack as local processes on loopback.

Starts the adapter store, the scheduler, N workers and the gateway as child processes (each dies
with the launcher), waits until every role reports healthy, prints the gateway's address, and
stops them all on Ctrl-C or SIGTERM. Meanwhile a role that exits or stops answering its health
check is restarted with backoff (`launcher/supervisor.py`); only a crash loop stops the stack.
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
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from loraserve import internal_auth
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.errors import InvalidConfigError, InvalidModelError
from loraserve.gateway.bind_rule import check_bind
from loraserve.gateway.tls import ClientTls, load_server_tls, load_up_client_tls
from loraserve.launcher.commands import add_arguments, internal_keys_dir, metrics_ports, role_commands
from loraserve.launcher.ports import Ports
from loraserve.launcher.supervisor import CrashLoop, Role, SupervisionConfig, Supervisor
from loraserve.process import become_service

__all__ = ["add_arguments", "main"]  # add_arguments: `loraserve up`'s flags (`commands.py`)

log = logging.getLogger(__name__)


def gateway_tls(args: argparse.Namespace) -> ClientTls | None:
    """How `up` reaches its gateway over TLS (None: plaintext); InvalidConfigError naming a bad flag."""
    server = load_server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
    if server is None:
        if args.tls_client_cert is not None or args.tls_client_key is not None:
            raise InvalidConfigError("--tls-client-cert and --tls-client-key are for a --tls-client-ca gateway")
        return None
    return load_up_client_tls(server, args.tls_server_name, args.tls_client_cert, args.tls_client_key)


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
        stack.stop(timeout_s=args.drain_timeout_s + 5.0)


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
