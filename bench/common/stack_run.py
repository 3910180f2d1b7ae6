"""The stack suites' shared run: a whole loraserve stack started by the launcher's `LocalStack` (the one
place that starts roles), and the calls every such suite makes of it.

    with local_stack(model_dir, workers=2, pool_pages=512) as stack:   # `up`'s flags, as keywords
        await api.UploadAdapter(upload_messages(name, *synthetic.files(name, rank)), timeout=120)
        state = await cluster_state(stack)

Without `data_dir`, the store keeps its uploads in a directory removed when the stack stops.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from loraserve.grpc_utils import internal_channel
from loraserve.launcher.local_stack import LocalStack
from loraserve.v1 import gateway_pb2, scheduler_pb2, scheduler_pb2_grpc

UPLOAD_CHUNK = 1 << 20


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
