"""loraserve as the peer suite runs it: the real stack (adapter store, scheduler, one worker,
gateway) as local processes, its OpenAI-compatible HTTP edge on a loopback port, and the adapters
uploaded through the public gRPC API — what a user of `loraserve up --http-bind` gets. The CPU set-up
vLLM's guide advises, for both: the worker on vLLM's OpenMP cores (`--cpu-cores`), tcmalloc preloaded.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from loraserve.bench.suites.peer.processes import wait_healthy
from loraserve.bench.suites.peer.vllm import bound_cores, tcmalloc
from loraserve.client import Client
from loraserve.launcher.local_stack import LocalStack
from loraserve.launcher.ports import free_port_block


@dataclass(frozen=True)
class LoraserveOptions:
    """The stack's engine settings the suite chooses."""

    model_dir: Path
    dtype: str
    max_batch_size: int
    threads: int  # the worker's torch threads
    pool_gb: float
    compile_model: bool  # --compile: the worker's layers compiled by inductor


class LoraserveServer:
    """A running stack with its HTTP edge; `stop` ends every role."""

    system = "loraserve"

    def __init__(self, stack: LocalStack, port: int, data_dir: tempfile.TemporaryDirectory):
        self.stack, self.port, self._data_dir = stack, port, data_dir

    @classmethod
    def start(cls, options: LoraserveOptions, adapters: dict[str, Path], timeout_s: float = 300.0) -> LoraserveServer:
        port = free_port_block(1)
        data_dir = tempfile.TemporaryDirectory(prefix="loraserve-peer-store-")  # uploads: not kept
        stack = LocalStack(
            options.model_dir,
            workers=1,
            http_bind=f"127.0.0.1:{port}",
            dtype=options.dtype,
            max_batch_size=options.max_batch_size,
            torch_threads=options.threads,
            cpu_pool_memory_gb=options.pool_gb,
            prefix_cache=False,  # every run prefills every prompt, as vLLM's does here
            data_dir=data_dir.name,
            cpu_cores=bound_cores(options.threads),  # the cores vLLM binds its OpenMP threads to
            compile=options.compile_model,  # `up --compile`
        )
        if allocator := tcmalloc():  # every role's, as vLLM's processes
            stack.stack.env = {**os.environ, "LD_PRELOAD": allocator}
        print(f"loraserve: starting the stack, HTTP on port {port}", flush=True)
        stack.start(timeout_s)
        server = cls(stack, port, data_dir)
        try:
            wait_healthy(f"http://127.0.0.1:{port}/health", 60.0, server.alive, interval_s=0.5)
            with Client(stack.address) as client:
                for name, path in adapters.items():
                    client.upload_adapter(name, path, timeout=120)
        except BaseException:
            server.stop()
            raise
        return server

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.stack.stack.children.values()]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.stack.stack.children.values())

    def pause(self) -> None:
        """Nothing (nor does `resume`): stopped roles would come back to a scheduler that counts the silence
        as a dead worker. Idle, the stack uses little CPU (the suite measures it)."""

    resume = pause

    def stop(self) -> None:
        try:
            self.stack.stop()
        finally:
            self._data_dir.cleanup()
