"""`loraserve bench --suite gateway`: the gateway's CPU time per token streamed, over gRPC and over HTTP.

    loraserve bench --suite gateway --quick --out /tmp/gateway     # about a minute on 2 CPU cores
    loraserve bench --suite gateway --out docs/gateway

A real stack (store, scheduler, one worker, gateway, as processes) on the demo model, whose worker runs
the emulated runner with a fixed 2 ms step: the worker costs almost no CPU and never holds the gateway
back on the model. `--gateway-streams` streams at once (64), each asking for `--gateway-tokens` tokens
(ignore_eos; half on an adapter, half on the base model), first as gRPC `GenerateStream` calls, then as
streamed HTTP `/v1/completions`, alternating `--gateway-runs` times. For each run the gateway process's
CPU seconds (user + system, read from its CPU-time clock to the nanosecond) are divided by the tokens
the clients received: the per-token cost of everything the gateway does for a stream (admission,
submission, reading the workers' messages, detokenizing, encoding, sending), amortized over the stream's
tokens.

DIR/results.json is {"suite", "machine", "commit", "records", "summary", "targets", "options"}; a record
is {"api", "run", "tokens", "wall_s", "gateway_cpu_s", "us_per_token"} (us_per_token null when no token
came back or no CPU time could be resolved); "summary" holds each API's median µs per token over its
measured runs. With `--gateway-baseline FILE` (an earlier run's results.json, e.g. of an older commit),
the targets are each API's baseline µs per token over this run's, goal >= 2; a target either side of
which has no figure is reported unjudged ("met": null) rather than divided by zero.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from loraserve.bench.common.calibration import fixed_profile
from loraserve.bench.common.cpu_clock import process_cpu_seconds
from loraserve.bench.common.preset import Preset
from loraserve.bench.common.results import judged, publish
from loraserve.bench.common.stack_run import local_stack
from loraserve.bench.common.stats import quantile, ratio
from loraserve.config_cli import setting
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.launcher.ports import free_port_block
from loraserve.v1 import gateway_pb2, gateway_pb2_grpc

STEP_S = 0.002  # the emulated worker's step
ADAPTER = "upper"
APIS = ("grpc", "http")


@dataclass(frozen=True)
class GatewayPreset(Preset):
    tokens: int  # per stream
    runs: int  # of each API, alternating


FULL, QUICK = GatewayPreset(tokens=400, runs=3), GatewayPreset(tokens=200, runs=2)


@dataclass(frozen=True)
class GatewaySettings:
    """The gateway suite's own flags (it also reads --quick and --out)."""

    gateway_streams: int = setting(64, "gateway suite: streams at once")
    gateway_tokens: int | None = setting(None, "gateway suite: tokens per stream (default 400; quick 200)")
    gateway_runs: int | None = setting(None, "gateway suite: runs of each API, alternating (default 3; quick 2)")
    gateway_baseline: Path | None = setting(
        None, "gateway suite: an earlier run's results.json; the targets compare with it (goal: 2x fewer µs per token)"
    )


SETTINGS = GatewaySettings


async def _grpc_tokens(address: str, streams: int, tokens: int) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        api = gateway_pb2_grpc.LoraServeStub(channel)

        async def one(i: int) -> int:
            request = gateway_pb2.GenerateRequest(adapter=ADAPTER if i % 2 else "", text="hello", max_new_tokens=tokens)
            request.sampling.ignore_eos = True
            received = 0
            async for event in api.GenerateStream(request, timeout=600):
                received += len(event.chunk.token_ids)
            return received

        return sum(await asyncio.gather(*map(one, range(streams))))


async def _http_tokens(url: str, model: str, streams: int, tokens: int) -> int:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams)) as http:

        async def one(i: int) -> int:
            body = {"model": ADAPTER if i % 2 else model, "prompt": "hello", "max_tokens": tokens, "stream": True}
            body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
            usage = 0
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"choices":[]' in line:  # include_usage's last chunk
                        usage = json.loads(line[6:])["usage"]["completion_tokens"]
            return usage

        return sum(await asyncio.gather(*map(one, range(streams))))


def _run(api: str, stack, url: str, gateway_pid: int, streams: int, tokens: int) -> dict:
    before, started = process_cpu_seconds(gateway_pid), time.perf_counter()
    if api == "grpc":
        received = asyncio.run(_grpc_tokens(stack.address, streams, tokens))
    else:
        received = asyncio.run(_http_tokens(url, DEMO_MODEL_DIR.name, streams, tokens))
    wall, cpu = time.perf_counter() - started, process_cpu_seconds(gateway_pid) - before
    record = {"api": api, "tokens": received, "wall_s": round(wall, 3), "gateway_cpu_s": round(cpu, 6)}
    per_token = ratio(cpu * 1e6, received, 1)  # None when no token came back
    return record | {"us_per_token": per_token or None}  # 0: less CPU than the clock resolves, not a cost


def _warm(url: str, deadline_s: float = 180.0) -> None:
    """Wait until the adapter answers (the store preloads the demo adapters as the stack starts)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            body = {"model": ADAPTER, "prompt": "hello", "max_tokens": 2}
            if httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the stack did not serve {ADAPTER!r} within {deadline_s:g} s")
        time.sleep(1)


def summarize(records: list[dict]) -> dict[str, float | None]:
    """Each API's median µs per token over its measured runs (None when no run of it was measured)."""
    return {
        api: quantile([r["us_per_token"] for r in records if r["api"] == api and r["us_per_token"]], 0.5, 1)
        for api in APIS
    }


def targets(summary: dict[str, float | None], baseline: Path) -> list[dict]:
    """Each API's µs per token at `baseline`'s run over this run's (goal: at least 2); not judged (met: None)
    where either run has no measured figure."""
    before = json.loads(baseline.read_text())
    name = "gateway µs per token at {} / now, {} (64 streams, emulated worker)"
    return [
        judged(name.format(before["commit"], api), ">= 2", ratio(before["summary"].get(api), summary[api], 2), None)
        for api in APIS
    ]


def main(args: argparse.Namespace) -> int:
    preset = (QUICK if args.quick else FULL).but(tokens=args.gateway_tokens, runs=args.gateway_runs)
    tokens, runs = preset.tokens, preset.runs
    with tempfile.TemporaryDirectory(prefix="loraserve-gateway-") as scratch:
        profile = fixed_profile(Path(scratch) / "runner_profile.json", step_s=STEP_S)
        port = free_port_block(1)
        options = {"runner": "emulated", "runner_profile": profile, "http_bind": f"127.0.0.1:{port}"}
        with local_stack(DEMO_MODEL_DIR, max_batch_size=args.gateway_streams, pool_pages=2048, **options) as stack:
            url = f"http://127.0.0.1:{port}"
            _warm(url)
            gateway_pid = stack.process("gateway").pid
            records = []
            for run in range(runs):
                for api in APIS:
                    records.append({"run": run} | _run(api, stack, url, gateway_pid, args.gateway_streams, tokens))
                    print(records[-1], flush=True)
    summary = summarize(records)
    options = {"streams": args.gateway_streams, "tokens": tokens, "runs": runs, "step_s": STEP_S}
    goals = targets(summary, args.gateway_baseline) if args.gateway_baseline else []
    print(f"gateway µs per token (median): {summary}")
    publish(args.out, "gateway", records, summary=summary, targets=goals, options=options)
    return 0
