"""`loraserve bench --suite control-plane`: how many requests per second one scheduler admits and places,
and how long each decision takes, at 64 workers and 10,000 adapters.

    loraserve bench --suite control-plane --quick --out /tmp/cp      # about a minute
    loraserve bench --suite control-plane --out results/cp

The scheduler process is real (`loraserve scheduler`, the policy under test); the workers are
`--cp-workers` emulated ones in one process (`workers.py`, which also records the decision
latencies), both started by the launcher's supervisor (`stack_run.supervised`: 64 real workers
would not fit the machine, so this is not `up`'s stack). This process stands for the gateways: it
submits over gRPC (prompt ids, the adapter with its rank and weights' hash, a tenant of 8,
sampling), open loop at each offered rate for the preset's phase, on `--cp-clients` channels, either
`stream` (batched on one SubmitStream call per channel, as gateways send them) or `unary` (one
Submit call each).

Per offered rate: admitted req/s, refusals, the Submit call's latency, the decision latency inside
the scheduler and end to end, and the scheduler's CPU use (its CPU-time clock: at one full core it is saturated).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import pstats
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import zmq

from loraserve.bench.common.cpu_clock import process_cpu_seconds
from loraserve.bench.common.preset import Preset
from loraserve.bench.common.results import cpu_fields, judged, publish
from loraserve.bench.common.stack_run import supervised
from loraserve.bench.common.stats import quantile
from loraserve.bench.suites.control_plane import profile_split
from loraserve.bench.workloads.slora import power_law_shares
from loraserve.config_cli import setting
from loraserve.errors import LoraserveError
from loraserve.gateway.submit_stream import SubmitStream
from loraserve.launcher.ports import free_port_block
from loraserve.launcher.supervisor import Role
from loraserve.scheduler.policy import POLICIES
from loraserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

WORKERS = 64
ADAPTERS = 10_000
RANKS = (8, 16, 32, 64)
TENANTS = 8
PROMPT = 32  # tokens per request
NEW_TOKENS = 16  # steps a request runs on its emulated worker
STEP_S = 0.02  # an emulated worker's step: 50 reports a second from each busy worker
SUBMITS = ("stream", "unary")  # how Submits travel: batched on a SubmitStream call, or one call each


@dataclass(frozen=True)
class ControlPlanePreset(Preset):
    rates: tuple[float, ...]  # offered Submit rates, req/s, one phase each
    phase_s: float
    policies: tuple[str, ...]
    submits: tuple[str, ...]


QUICK = ControlPlanePreset((250, 1000, 2500, 5000), 4.0, ("adaptive",), ("stream",))
FULL = ControlPlanePreset((250, 500, 1000, 1500, 2000, 3000, 5000), 8.0, POLICIES, SUBMITS)
TARGET_RATE = 5000.0  # req/s admitted
TARGET_P99_S = 0.001  # decision latency
SUBMIT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ControlPlaneSettings:
    """The control-plane suite's own flags (it also reads --quick, --out, --seed)."""

    cp_workers: int = setting(WORKERS, "emulated workers reporting to the scheduler")
    cp_adapters: int = setting(ADAPTERS, "adapters the requests ask for (Zipf α = 1)")
    cp_rates: tuple[float, ...] | None = setting(None, "offered Submit rates, req/s (default: the preset's)", nargs="+")
    cp_policies: tuple[str, ...] | None = setting(
        None, "policies to measure (default: the preset's)", nargs="+", choices=POLICIES
    )
    cp_clients: int = setting(4, "gRPC channels the Submits go out on (one gateway each)")
    cp_submit: tuple[str, ...] | None = setting(
        None,
        "how Submits travel: stream (batched on one SubmitStream call per channel, as gateways send them) "
        "or unary (one Submit call each); default: the preset's",
        nargs="+",
        choices=SUBMITS,
    )
    cp_step_s: float = setting(
        STEP_S, "an emulated worker's step while it holds requests: it reports after each (the report cadence)"
    )
    cp_profile: bool = setting(
        False, "run the scheduler under cProfile: --out/scheduler-POLICY.prof, and its top functions printed"
    )


SETTINGS = ControlPlaneSettings


def _sha(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


class Catalogue:
    """The adapters requests ask for: Zipf α = 1 over `n` names, ranks round robin, a weights hash each."""

    def __init__(self, n: int, seed: int):
        self.names = [f"cp-{i:05d}" for i in range(n)]
        self.rng = np.random.default_rng(seed)
        self.p = power_law_shares(n, 1.0)
        self.hashes = [_sha(name) for name in self.names]

    def draw(self, count: int) -> np.ndarray:
        return self.rng.choice(len(self.names), size=count, p=self.p)


class Clients:
    """Submits over `channels` gRPC channels, as gateways send them: on one SubmitStream call each
    (`submit` "stream"), or one Submit call each ("unary")."""

    def __init__(self, address: str, channels: int, reply_to: str, catalogue: Catalogue, seed: int, submit: str):
        self.channels = [grpc.aio.insecure_channel(address) for _ in range(channels)]
        self.stubs = [scheduler_pb2_grpc.SchedulerStub(c) for c in self.channels]
        self.streams = [SubmitStream(stub, SUBMIT_TIMEOUT_S) for stub in self.stubs] if submit == "stream" else None
        self.reply_to, self.catalogue = reply_to, catalogue
        rng = np.random.default_rng(seed + 1)
        self.prompts = [[int(t) for t in rng.integers(3, 1000, PROMPT)] for _ in range(64)]
        self.sampling = common_pb2.SamplingParameters(ignore_eos=True)

    async def phase(self, name: str, rate: float, seconds: float) -> dict:
        """Submit at `rate` for `seconds` (open loop); the calls' outcomes and latencies."""
        n = int(rate * seconds)
        picks = self.catalogue.draw(n)
        latencies: list[float] = []
        codes: dict[str, int] = {}
        start = time.monotonic()
        tasks = set()

        async def one(i: int) -> None:
            a = int(picks[i])
            request = scheduler_pb2.SubmitRequest(
                request_id=f"{name}/{i}",
                prompt_ids=self.prompts[i % len(self.prompts)],
                adapter=self.catalogue.names[a],
                adapter_version=1,
                sampling=self.sampling,
                max_new_tokens=NEW_TOKENS,
                reply_to=self.reply_to,
                arrival_unix=time.time(),
                adapter_sha256=self.catalogue.hashes[a],
                tenant=f"tenant-{i % TENANTS}",
                adapter_rank=RANKS[a % len(RANKS)],
            )
            sent = time.perf_counter()
            try:
                if self.streams is not None:
                    await self.streams[i % len(self.streams)].submit(request)
                else:
                    await self.stubs[i % len(self.stubs)].Submit(request, timeout=SUBMIT_TIMEOUT_S)
                latencies.append(time.perf_counter() - sent)
                codes["OK"] = codes.get("OK", 0) + 1
            except grpc.aio.AioRpcError as e:
                codes[e.code().name] = codes.get(e.code().name, 0) + 1
            except LoraserveError as e:
                codes[e.status] = codes.get(e.status, 0) + 1

        for i in range(n):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        sent_s = time.monotonic() - start
        await asyncio.gather(*tasks)
        return {
            "offered_req_per_s": rate,
            "sent": n,
            "send_s": round(sent_s, 3),  # > seconds: the client could not send at the rate
            "codes": codes,
            "admitted_req_per_s": round(codes.get("OK", 0) / max(sent_s, seconds), 1),
            "submit_p50_s": quantile(latencies, 0.5, 6),
            "submit_p99_s": quantile(latencies, 0.99, 6),
        }

    async def close(self) -> None:
        for stream in self.streams or ():
            await stream.close()
        for channel in self.channels:
            await channel.close()


def roles(policy: str, base: int, args: argparse.Namespace, latencies: Path, profile: Path | None) -> list[Role]:
    """The scheduler under test (under cProfile with `profile`) and the emulated fleet, which writes the
    decision latencies to `latencies` when stopped (first: the fleet stops before the scheduler)."""
    python = [sys.executable, *(["-m", "cProfile", "-o", str(profile)] if profile else [])]
    grpc_address, worker_address = f"127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"
    scheduler = [*python, "-m", "loraserve.cli", "--log-level", "ERROR", "scheduler", "--bind", grpc_address]
    scheduler += ["--worker-address", worker_address, "--policy", policy, "--max-queue-length", "4096"]
    fleet = [sys.executable, "-m", "loraserve.bench.suites.control_plane.workers", "--scheduler", worker_address]
    fleet += ["--workers", str(args.cp_workers), "--adapters", str(args.cp_adapters), "--step-s", str(args.cp_step_s)]
    return [Role("scheduler", scheduler, stop_group=1), Role("workers", [*fleet, "--out", str(latencies)])]


async def wait_ready(address: str, workers: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        while True:
            try:
                state = await stub.GetClusterState(scheduler_pb2.GetClusterStateRequest(), timeout=2)
                if sum(w.ready for w in state.workers) >= workers:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{workers} emulated workers not registered after {timeout_s} s")
            await asyncio.sleep(0.2)


async def measure(
    policy: str, submit: str, preset: ControlPlanePreset, args: argparse.Namespace, scratch: Path, profile: Path | None
) -> dict:
    """One policy and way of submitting, on a fresh scheduler and fleet: a phase per offered rate."""
    base = free_port_block(3)
    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)  # failures the scheduler sends "gateways" (there should be none)
    reply_to = f"tcp://127.0.0.1:{base + 2}"
    sink.bind(reply_to)
    latencies_file = scratch / f"workers-{policy}-{submit}.json"
    phases = []
    try:
        with supervised(roles(policy, base, args, latencies_file, profile), stop_s=30.0) as fleet:
            grpc_address = f"127.0.0.1:{base}"
            await wait_ready(grpc_address, args.cp_workers)
            scheduler_pid = fleet.children["scheduler"].pid
            catalogue = Catalogue(args.cp_adapters, args.seed)
            clients = Clients(grpc_address, args.cp_clients, reply_to, catalogue, args.seed, submit)
            await clients.phase("warm", 200.0, 1.0)
            await asyncio.sleep(1.0)
            for rate in preset.rates:
                name = f"r{int(rate)}"
                before, wall = process_cpu_seconds(scheduler_pid), time.monotonic()
                result = await clients.phase(name, rate, preset.phase_s)
                used = process_cpu_seconds(scheduler_pid) - before
                result["scheduler_cpu"] = round(used / (time.monotonic() - wall), 3)
                result["phase"] = name
                phases.append(result)
                log.info("%s %s %s: %s", policy, submit, name, {k: v for k, v in result.items() if k != "codes"})
                await asyncio.sleep(1.0)  # the emulated workers finish what they hold
            await clients.close()
    finally:
        sink.close(linger=0)
        ctx.term()
    recorded = json.loads(latencies_file.read_text())["phases"]
    for result in phases:
        got = recorded.get(result["phase"], {})
        queued, e2e = got.get("queued_s", []), got.get("end_to_end_s", [])
        result["assigned"] = len(queued)
        span = (got.get("last_unix") or 0) - (got.get("first_unix") or 0)
        result["assigned_req_per_s"] = round(len(queued) / span, 1) if span > 0 else None
        result |= {"decision_p50_s": quantile(queued, 0.5, 6), "decision_p99_s": quantile(queued, 0.99, 6)}
        result |= {"decision_max_s": round(max(queued), 6) if queued else None}
        result |= {"end_to_end_p50_s": quantile(e2e, 0.5, 6), "end_to_end_p99_s": quantile(e2e, 0.99, 6)}
        result["kept_up"] = kept_up(result)
    return {"policy": policy, "submit": submit, "phases": phases}


def kept_up(phase: dict) -> bool:
    """The scheduler kept up with the offered rate: (nearly) every Submit answered OK and placed, and no
    request waited a second between its Submit and its ASSIGN."""
    placed = phase.get("assigned", 0) >= 0.99 * phase["sent"]
    prompt = (phase.get("end_to_end_p99_s") or 0.0) <= 1.0
    return phase["codes"].get("OK", 0) >= 0.99 * phase["sent"] and placed and prompt


def verdict(runs: list[dict]) -> list[dict]:
    """The targets on the default policy: the highest offered rate it kept up with (`kept_up`), and the
    decision p99 at the target rate."""
    out = []
    for run in runs:
        if run["policy"] != POLICIES[0] or run["submit"] != SUBMITS[0]:
            continue
        kept = [p for p in run["phases"] if kept_up(p)]
        best = max((p["admitted_req_per_s"] for p in kept), default=0.0)
        at_target = next((p for p in run["phases"] if p["offered_req_per_s"] >= TARGET_RATE), None)
        p99 = at_target["decision_p99_s"] if at_target else None
        out.append(judged("admitted req/s", f">= {TARGET_RATE:g}", best))
        out.append(judged(f"decision p99 at {TARGET_RATE:g} req/s offered (s)", f"<= {TARGET_P99_S}", p99))
    return out


def main(args: argparse.Namespace) -> int:
    preset = (QUICK if args.quick else FULL).but(rates=args.cp_rates, policies=args.cp_policies, submits=args.cp_submit)
    out = args.out or Path(tempfile.mkdtemp(prefix="loraserve-cp-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs = []
    profiles: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="loraserve-cp-") as scratch:
        for policy in preset.policies:
            for submit in preset.submits:
                profile = out / f"scheduler-{policy}-{submit}.prof" if args.cp_profile else None
                runs.append(asyncio.run(measure(policy, submit, preset, args, Path(scratch), profile)))
                if profile is not None and profile.exists():
                    profiles[f"{policy}-{submit}"] = profile_split.split(profile)
                    print(f"--- the scheduler under {policy}, {submit} Submits: where its time went ({profile})")
                    pstats.Stats(str(profile)).sort_stats("tottime").print_stats(25)
    fields = {
        "what": "a real scheduler process; emulated workers in one process speaking the worker protocol; "
        "this process submitting as gateways do (stream) or one call per Submit (unary)",
        "workers": args.cp_workers,
        "adapters": args.cp_adapters,
        "step_s": args.cp_step_s,
        "phase_s": preset.phase_s,
        "targets": verdict(runs),
        "wall_s": round(time.perf_counter() - started, 1),
    } | ({"profile": profiles} if profiles else {})
    for run in runs:
        for p in run["phases"]:
            print(
                f"{run['policy']:>8} {run['submit']:>6} offered {p['offered_req_per_s']:>6g}/s: "
                f"admitted {p['admitted_req_per_s']:>7}/s (refused {p['sent'] - p['codes'].get('OK', 0)}), "
                f"decision p50/p99 {p['decision_p50_s']}/{p['decision_p99_s']} s, "
                f"end to end p99 {p['end_to_end_p99_s']} s, scheduler CPU {p['scheduler_cpu']}"
                f"{'' if p['kept_up'] else ' (fell behind)'}"
            )
    machine = cpu_fields() | {"pid_cpus": len(os.sched_getaffinity(0))}
    publish(out, "control-plane", runs, machine_extra=machine, runs=runs, **fields)
    return 0
