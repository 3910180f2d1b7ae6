"""The stack suites' processes, always started by the launcher (the one place that starts roles), and the
calls every such suite makes of them.

    with local_stack(model_dir, workers=2, pool_pages=512) as stack:   # `up`'s flags, as keywords
        await api.UploadAdapter(upload_messages(name, *synthetic.files(name, rank)), timeout=120)
        state = await cluster_state(stack)
    with store_process(model_dir, adapter_dir, workdir, transport="tcp") as data_address:  # the store alone
        fetcher = AdapterFetcher(data_address, 30.0)
    with supervised([Role("scheduler", command, address)]) as roles: ...   # roles the suite composes itself

Without `data_dir`, the stack's store keeps its uploads in a directory removed when the stack stops. The
store alone preloads one adapter (`ADAPTER_NAME`) from `adapter_dir`, keeps its data under `workdir` and
serves its data plane over loopback TCP or a unix socket in `workdir`. Nothing restarts a role that dies
here: no one calls the supervisor's `tick()`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from loraserve.grpc_utils import internal_channel
from loraserve.launcher.local_stack import LocalStack
from loraserve.launcher.ports import free_port_block
from loraserve.launcher.supervisor import Role, Supervisor
from loraserve.launcher.up import wait_healthy
from loraserve.v1 import gateway_pb2, scheduler_pb2, scheduler_pb2_grpc

UPLOAD_CHUNK = 1 << 20
ADAPTER_NAME = "bench-7b"


@contextmanager
def local_stack(model: Path, workers: int = 1, timeout_s: float = 180.0, **options: object) -> Iterator[LocalStack]:
    """A started stack on `model` with `workers` workers and `up`'s `options`; stopped on exit."""
    with ExitStack() as scope:
        if "data_dir" not in options:
            options["data_dir"] = scope.enter_context(tempfile.TemporaryDirectory(prefix="loraserve-bench-store-"))
        stack = LocalStack(model, workers=workers, **options).start(timeout_s)
        try:
            yield stack
        finally:
            stack.stop()


@contextmanager
def supervised(roles: list[Role], env: dict[str, str] | None = None, stop_s: float = 10.0) -> Iterator[Supervisor]:
    """`roles` started by the launcher's supervisor (in order; `env`: theirs, None: this process's), stopped
    on exit group by group (`Role.stop_group`), each group given `stop_s`."""
    supervisor = Supervisor(roles, env=env)
    supervisor.start()
    try:
        yield supervisor
    finally:
        supervisor.stop(stop_s)


@contextmanager
def store_process(
    model_dir: Path, adapter_dir: Path, workdir: Path, transport: str = "tcp", timeout_s: float = 120.0
) -> Iterator[str]:
    """The store serving `adapter_dir` as ADAPTER_NAME, healthy; yields its data-plane address."""
    base = free_port_block(2)
    grpc_address = f"127.0.0.1:{base}"
    data_address = f"tcp://127.0.0.1:{base + 1}" if transport == "tcp" else f"ipc://{workdir / 'data.ipc'}"
    command = [sys.executable, "-m", "loraserve.cli", "--log-level", "WARNING", "adapter-store"]
    command += ["--model", str(model_dir), "--bind", grpc_address, "--data-address", data_address]
    command += ["--preload", f"{ADAPTER_NAME}={adapter_dir}", "--no-preload-demo"]
    command += ["--data-dir", str(workdir / "store-data")]  # the suite's own, removed with its work dir
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORASERVE_")}
    with supervised([Role("adapter-store", command, grpc_address)], env) as store:
        wait_healthy([grpc_address], store, timeout_s)
        yield data_address


def upload_messages(name: str, config: bytes, weights: bytes) -> Iterator[gateway_pb2.UploadAdapterRequest]:
    """An `UploadAdapter` stream of adapter `name`'s two files (the weights in 1 MiB chunks)."""
    yield gateway_pb2.UploadAdapterRequest(header=gateway_pb2.UploadHeader(name=name))
    yield gateway_pb2.UploadAdapterRequest(chunk=gateway_pb2.FileChunk(file="adapter_config.json", data=config))
    for i in range(0, len(weights), UPLOAD_CHUNK):
        chunk = gateway_pb2.FileChunk(file="adapter_model.safetensors", data=weights[i : i + UPLOAD_CHUNK])
        yield gateway_pb2.UploadAdapterRequest(chunk=chunk)


async def cluster_state(stack: LocalStack, timeout_s: float = 10.0) -> scheduler_pb2.ClusterState:
    """The scheduler's view of the workers, over its internal port."""
    async with internal_channel(stack.ports.scheduler, stack.internal_token) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return await stub.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=timeout_s)
