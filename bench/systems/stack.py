"""loraserve through the whole gRPC stack as a benchmark system.

Starts the stack as local processes (adapter store, scheduler, one worker, gateway), uploads the
trace's adapters through the public API, then replays the trace in real time: each request is a
`GenerateStream` call on an asyncio gRPC channel, opened when its arrival time comes. Compared
with the in-process `loraserve` system on the same trace, the difference is what the services
cost: gRPC, the scheduler hop, ZMQ token streaming, detokenization.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from loraserve.bench.common.stack_run import cluster_state, local_stack, upload_messages
from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.bench.systems.base import LastRunStats, Replay, ReplayLimits, RequestRecord
from loraserve.bench.workloads.slora import Trace, TraceRequest
from loraserve.launcher.local_stack import LocalStack
from loraserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


@dataclass
class StackSystem(LastRunStats):
    adapters: SyntheticAdapters
    pool_pages: int
    max_batch_size: int
    limits: ReplayLimits = field(default_factory=ReplayLimits)
    torch_threads: int = 1  # the worker's, as the in-process systems get --threads
    name: str = "loraserve-stack"
    device: str = "cpu"  # the worker's
    workers: int = 1
    policy: str | None = None  # the scheduler's --policy (None: its default)

    def run(self, trace: Trace) -> list[RequestRecord]:
        with local_stack(
            Path(self.adapters.model_dir),
            workers=self.workers,
            **({} if self.policy is None else {"policy": self.policy}),  # None: `up`'s default policy
            pool_pages=self.pool_pages,
            max_batch_size=self.max_batch_size,
            torch_threads=self.torch_threads,
            device=self.device,
        ) as stack:
            return asyncio.run(self._run(stack, trace))

    async def _run(self, stack: LocalStack, trace: Trace) -> list[RequestRecord]:
        async with grpc.aio.insecure_channel(stack.address) as channel:
            api = gateway_pb2_grpc.LoraServeStub(channel)
            for name, rank in trace.adapters.items():
                await api.UploadAdapter(upload_messages(name, *self.adapters.files(name, rank)), timeout=120)
            warm = next(iter(trace.adapters), "")
            await api.Generate(gateway_pb2.GenerateRequest(adapter=warm, text="warm up", max_new_tokens=2), timeout=60)
            replay = Replay(trace, self.name, self.limits)
            replay.start()
            tasks: set[asyncio.Task] = set()
            while not replay.done:
                for request in replay.due():
                    task = asyncio.create_task(_stream(api, request, replay))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                next_arrival = replay.pending[0].arrival_s if replay.pending else replay.deadline_s
                await asyncio.sleep(min(0.05, max(0.0, next_arrival - replay.now())))
            for task in list(tasks):  # past the deadline: cancel what is left (the stack frees it)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._stats = await _cluster_stats(stack)
            return replay.results()


async def _stream(api: gateway_pb2_grpc.LoraServeStub, request: TraceRequest, replay: Replay) -> None:
    message = gateway_pb2.GenerateRequest(
        adapter=request.adapter,
        token_ids=gateway_pb2.TokenIds(ids=list(request.prompt_ids)),
        max_new_tokens=request.max_new_tokens,
        sampling=common_pb2.SamplingParameters(ignore_eos=True, seed=0),
    )
    try:
        async for event in api.GenerateStream(message, timeout=replay.deadline_s + 60):
            if event.HasField("chunk"):
                replay.tokens(request.request_id, len(event.chunk.token_ids))
        replay.finish(request.request_id)
    except grpc.aio.AioRpcError as e:
        replay.finish(request.request_id, error=f"{e.code().name}: {e.details()}")


async def _cluster_stats(stack: LocalStack) -> dict:
    state = await cluster_state(stack)
    hits = sum(w.prefetch_hits for w in state.workers)
    misses = sum(w.prefetch_misses for w in state.workers)
    return {
        "pool_waste_fraction": sum(w.pool_waste_fraction for w in state.workers) / max(len(state.workers), 1),
        "prefetch_hit_rate": hits / (hits + misses) if hits + misses else None,
        "steps": sum(w.steps for w in state.workers),
    }
