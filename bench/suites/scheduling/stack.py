"""One scheduling-benchmark run on the REAL stack: a trace replayed through a fresh `loraserve up` of
emulated workers.

    run = StackRunner(StackConfig(model_dir, profile, data_dir, workers=4, policy="fcfs")).run(trace, slo_of)

Every process is real: the adapter store (its data directory already holds the trace's adapters:
`upload_adapters`), the scheduler with `--policy`, `workers` worker processes with the emulated
runner (`--runner emulated --runner-profile`: the real worker, engine, pool, adapter fetches and
prefetches, with each step's forward pass replaced by a wait of the time the profile predicts), and
the gateway. This process is the client: each request is a `GenerateStream` call on one asyncio
gRPC channel, sent when its arrival time comes — a conversation's follow-up turn `think_s` after
its predecessor ended — with its tenant in `x-loraserve-client` and its TTFT target in
`ttft_slo_s`. Times are on the client's clock from the replay's start: TTFT is the first token's
arrival here minus the request's send time, so the gateway, the scheduler, gRPC and ZMQ are all
charged, as a user sees them.

Per request the worker's `Timings` come back with the summary: `adapter_load_s` (what the request
waited for its adapter: a fetch from the store it was parked on, plus the copy into the pool a step
waited for) and `queue_s`. Per worker, `GetClusterState` gives the pool's prefetch hits and misses,
and each worker's metrics endpoint how each adapter request found its adapter when it arrived
(`loraserve_worker_adapter_requests{found=...}`) and how long its steps took
(`loraserve_worker_step_seconds`). Per run, the machine's CPU busy share (`/proc/stat`, every process
on it): near 1, the cores, not the emulated device, set the pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import psutil

from loraserve.bench.common.stack_run import cluster_state, local_stack, upload_messages
from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.bench.workloads.scheduling import SchedRequest, SchedTrace
from loraserve.bench.workloads.slora import FIRST_TOKEN_ID
from loraserve.gateway.validation import CLIENT_METADATA
from loraserve.launcher.local_stack import LocalStack
from loraserve.launcher.ports import free_port_block
from loraserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)
STATUS_REFUSED = "RESOURCE_EXHAUSTED"  # early refusal, a full queue: the scheduler said no at once
FOUND = ("resident", "ready", "loading", "cold")  # worker/service.py's adapter_requests labels
UPLOADERS = 4


@dataclass(frozen=True)
class StackConfig:
    model_dir: Path
    runner_profile: Path  # the emulated runner's (`bench --suite runner-profile`), possibly time-scaled
    data_dir: Path  # the adapter store's data directory, holding every adapter the traces use
    workers: int = 4
    max_batch_size: int = 32
    pool_pages: int = 1536
    policy: str = "adaptive"
    prefetch: bool = True  # the workers' --prefetch
    drain_s: float = 30.0  # after the last first-turn arrival; then what is left is cut
    ready_timeout_s: float = 120.0


@dataclass
class Outcome:
    """One request as the client saw it; times on the replay's clock."""

    request: SchedRequest
    slo_s: float
    sent_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    status: str = "unsent"  # ok | refused | failed | unfinished (cut at the deadline) | unsent
    reason: str = ""
    queue_s: float | None = None  # the worker's Timings: scheduler queue + the worker's until its first step
    adapter_load_s: float = 0.0  # the worker's Timings: waiting for its adapter (fetch it was parked on, copy)
    worker: str = ""
    failovers: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None or self.sent_s is None else self.first_token_s - self.sent_s


@dataclass
class StackRun:
    outcomes: list[Outcome]
    workers: dict[str, dict]  # worker id -> pool counters (ClusterState), adapter requests by how found, steps
    wall_s: float
    started_s: float  # the stack's start-up
    extra: dict = field(default_factory=dict)  # cpu_busy: the machine's CPU busy share during the run


def workload_ids(request: SchedRequest, vocab_size: int, seed: int) -> list[int]:
    """Prompt token ids, seeded per request; a conversation's turns share the leading tokens of one
    stream (a follow-up's prompt extends its predecessor's)."""
    key = request.stream or request.request_id
    rng = np.random.default_rng([seed, *key.encode()])
    return [int(t) for t in rng.integers(FIRST_TOKEN_ID, vocab_size, request.prompt_len)]


def upload_adapters(model_dir: Path, data_dir: Path, adapters: dict[str, int], profile: Path, seed: int = 0) -> float:
    """Register `adapters` (name -> rank, synthetic weights) in a store at `data_dir` through the gateway
    of a stack started for it (one emulated worker: the gateway serves once one is ready); later stacks
    on `data_dir` find them there. Returns seconds."""
    options = {"runner": "emulated", "runner_profile": profile}
    started = time.perf_counter()
    synthetic = SyntheticAdapters(model_dir, seed=seed)

    async def upload(stack: LocalStack) -> None:
        async with grpc.aio.insecure_channel(stack.address) as channel:
            api = gateway_pb2_grpc.LoraServeStub(channel)
            names = iter(adapters.items())

            async def uploader() -> None:  # a few at a time: the store works while the next is made
                for name, rank in names:
                    files = await asyncio.to_thread(synthetic.files, name, rank)
                    await api.UploadAdapter(upload_messages(name, *files), timeout=120)

            await asyncio.gather(*(uploader() for _ in range(UPLOADERS)))

    with local_stack(model_dir, data_dir=str(data_dir), child_log_level="ERROR", **options) as stack:
        asyncio.run(upload(stack))
    return time.perf_counter() - started


@dataclass(frozen=True)
class Phase:
    """A trace to replay on a stack; `sequential`: one request at a time (each sent when the last ended),
    the unloaded latencies; else each at its arrival time."""

    trace: SchedTrace
    slo_of: Callable[[SchedRequest], float] = lambda r: 0.0  # its TTFT target, seconds (0: none)
    sequential: bool = False


class StackRunner:
    def __init__(self, config: StackConfig, vocab_size: int, seed: int = 0):
        self.config, self.vocab_size, self.seed = config, vocab_size, seed

    def run(self, phases: list[Phase]) -> list[StackRun]:
        """Start a fresh stack, replay each phase through it in turn, stop it."""
        c = self.config
        scratch = Path(tempfile.mkdtemp(prefix="loraserve-sched-"))  # the stack's internal keys
        started = time.perf_counter()
        stack = None
        try:
            with _held_ports(3 + c.workers) as metrics_base:  # the roles' metrics: how workers found adapters
                stack = LocalStack(
                    c.model_dir,
                    workers=c.workers,
                    policy=c.policy,
                    runner="emulated",
                    runner_profile=c.runner_profile,
                    pool_pages=c.pool_pages,
                    max_batch_size=c.max_batch_size,
                    prefetch=c.prefetch,
                    data_dir=str(c.data_dir),
                    internal_keys=str(scratch / "keys"),
                    metrics_port=metrics_base,
                    child_log_level="ERROR",
                )
            stack.start(c.ready_timeout_s)
            return asyncio.run(self._phases(stack, phases, metrics_base, time.perf_counter() - started))
        finally:
            if stack is not None:
                stack.stop()
            shutil.rmtree(scratch, ignore_errors=True)

    async def _phases(self, stack: LocalStack, phases: list[Phase], metrics_base: int, up_s: float) -> list[StackRun]:
        await self._wait_workers(stack)
        runs = []
        options = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(stack.address, options=options) as channel:
            api = gateway_pb2_grpc.LoraServeStub(channel)
            for _ in range(4):  # the channel, the gateway's and the scheduler's paths (base model: no adapter)
                await api.Generate(gateway_pb2.GenerateRequest(text="warm up", max_new_tokens=2), timeout=60)
            before = await self._counters(stack, metrics_base)
            for phase in phases:
                wall = time.perf_counter()
                psutil.cpu_percent()  # the machine's busy share is measured from here
                if phase.sequential:
                    outcomes = await self._sequential(api, phase)
                else:
                    outcomes = await self._replay(api, phase)
                wall_s = time.perf_counter() - wall
                after = await self._counters(stack, metrics_base)
                workers = {w: {k: v - before.get(w, {}).get(k, 0) for k, v in c.items()} for w, c in after.items()}
                extra = {"cpu_busy": round(psutil.cpu_percent() / 100, 3)}  # user .. steal, of every CPU
                runs.append(StackRun(outcomes, workers, round(wall_s, 2), round(up_s, 2), extra))
                before = after
        return runs

    async def _wait_workers(self, stack: LocalStack) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while len([w for w in (await cluster_state(stack)).workers if w.ready]) < self.config.workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.config.workers} workers not ready after {self.config.ready_timeout_s} s")
            await asyncio.sleep(0.2)

    async def _counters(self, stack: LocalStack, metrics_base: int) -> dict[str, dict[str, float]]:
        """Per worker: the pool's prefetch counters (ClusterState), its adapter requests by how they found
        their adapter and its steps' total time (its metrics endpoint); cumulative since it started."""
        state = await cluster_state(stack)
        out = {}
        for w in state.workers:
            port = metrics_base + 3 + int(w.worker_id.rsplit("-", 1)[1])  # up's order: gateway, scheduler, store
            found = await asyncio.to_thread(_found, port)
            out[w.worker_id] = {"prefetch_hits": w.prefetch_hits, "prefetch_misses": w.prefetch_misses} | found
            out[w.worker_id]["steps"] = w.steps
        return out

    async def _sequential(self, api: gateway_pb2_grpc.LoraServeStub, phase: Phase) -> list[Outcome]:
        t0 = time.monotonic()
        outcomes = [Outcome(r, phase.slo_of(r)) for r in phase.trace.requests]
        for outcome in outcomes:
            await self._one(api, outcome, lambda: time.monotonic() - t0)
        return outcomes

    async def _replay(self, api: gateway_pb2_grpc.LoraServeStub, phase: Phase) -> list[Outcome]:
        trace = phase.trace
        outcomes = {r.request_id: Outcome(r, phase.slo_of(r)) for r in trace.requests}
        followers = {r.follows: r for r in trace.requests if r.follows is not None}
        first = [r for r in trace.requests if r.follows is None]
        t0 = time.monotonic()

        def clock() -> float:
            return time.monotonic() - t0

        async def chain(request: SchedRequest | None) -> None:
            while request is not None:
                await self._one(api, outcomes[request.request_id], clock)
                request = followers.get(request.request_id)
                if request is not None:
                    await asyncio.sleep(request.think_s)

        tasks = []
        for request in first:
            await asyncio.sleep(max(0.0, request.arrival_s - clock()))
            tasks.append(asyncio.create_task(chain(request)))
        deadline = (first[-1].arrival_s if first else 0.0) + self.config.drain_s
        late: set[asyncio.Task] = set()
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=max(0.0, deadline - clock()))
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        return list(outcomes.values())

    async def _one(self, api: gateway_pb2_grpc.LoraServeStub, outcome: Outcome, clock: Callable[[], float]) -> None:
        r = outcome.request
        message = gateway_pb2.GenerateRequest(
            adapter=r.adapter or "",
            token_ids=gateway_pb2.TokenIds(ids=workload_ids(r, self.vocab_size, self.seed)),
            max_new_tokens=r.output_len,
            sampling=common_pb2.SamplingParameters(ignore_eos=True, seed=0),
            ttft_slo_s=outcome.slo_s,
        )
        metadata = ((CLIENT_METADATA, r.tenant),) if r.tenant else ()
        outcome.sent_s, outcome.status = clock(), "unfinished"
        try:
            async for event in api.GenerateStream(message, timeout=600, metadata=metadata):
                if event.HasField("chunk"):
                    if event.chunk.token_ids and outcome.first_token_s is None:
                        outcome.first_token_s = clock()
                elif event.HasField("summary"):
                    s = event.summary
                    outcome.queue_s, outcome.adapter_load_s = s.timings.queue_s, s.timings.adapter_load_s
                    outcome.worker, outcome.failovers = s.worker_id, s.failovers
            outcome.finished_s, outcome.status = clock(), "ok"
        except grpc.aio.AioRpcError as e:
            outcome.status = "refused" if e.code().name == STATUS_REFUSED else "failed"
            outcome.reason = f"{e.code().name}: {e.details()}"


@contextlib.contextmanager
def _held_ports(count: int) -> Iterator[int]:
    """A block of `count` free loopback ports, held bound while the stack picks its own ports (so that
    it cannot pick these) and released for the roles to bind; yields the first."""
    first = free_port_block(count)
    held = []
    try:
        for port in range(first, first + count):
            held.append(socket.socket())
            held[-1].bind(("127.0.0.1", port))
        yield first
    finally:
        for s in held:
            s.close()


def _found(port: int) -> dict[str, float]:
    """A worker's adapter requests by how each found its adapter when it arrived, and the total time and
    count of its steps (worker metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError as e:
        log.warning("could not read worker metrics on port %d: %s", port, e)
        return {}
    counts: Counter[str] = Counter()
    step = {"loraserve_worker_step_seconds_sum": "step_s", "loraserve_worker_step_seconds_count": "step_n"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "loraserve_worker_adapter_requests_total":
                counts[f"found_{sample.labels.get('found', '')}"] += int(sample.value)
            elif sample.name in step:
                counts[step[sample.name]] += sample.value
    return dict(counts)
