"""An adapter store alone, started by the launcher's supervisor, for the suites that time fetches from it.

    with store_process(model_dir, adapter_dir, workdir, transport="tcp") as data_address:
        fetcher = AdapterFetcher(data_address, 30.0)

The store preloads one adapter (`ADAPTER_NAME`) from `adapter_dir`, keeps its data under `workdir`, and
serves its data plane over loopback TCP or a unix socket in `workdir`; the context waits until its gRPC
health service says SERVING and stops it on exit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loraserve.launcher.ports import free_port_block
from loraserve.launcher.supervisor import Role, Supervisor
from loraserve.launcher.up import wait_healthy

ADAPTER_NAME = "bench-7b"


@contextmanager
def store_process(
    model_dir: Path, adapter_dir: Path, workdir: Path, transport: str = "tcp", timeout_s: float = 120.0
) -> Iterator[str]:
    """The store serving `adapter_dir` as ADAPTER_NAME; yields its data-plane address."""
    base = free_port_block(2)
    grpc_address = f"127.0.0.1:{base}"
    data_address = f"tcp://127.0.0.1:{base + 1}" if transport == "tcp" else f"ipc://{workdir / 'data.ipc'}"
    command = [sys.executable, "-m", "loraserve.cli", "--log-level", "WARNING", "adapter-store"]
    command += ["--model", str(model_dir), "--bind", grpc_address, "--data-address", data_address]
    command += ["--preload", f"{ADAPTER_NAME}={adapter_dir}", "--no-preload-demo"]
    command += ["--data-dir", str(workdir / "store-data")]  # the suite's own, removed with its work dir
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORASERVE_")}
    store = Supervisor([Role("adapter-store", command, grpc_address)], env=env)
    store.start()
    try:
        wait_healthy([grpc_address], store, timeout_s)
        yield data_address
    finally:
        store.stop()
