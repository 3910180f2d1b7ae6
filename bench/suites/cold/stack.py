"""The cold penalty on the real stack: TTFT of a request whose adapter is resident nowhere, against the same
request warm, per rank, on real processes with the real runner.

For each rank, `trials` adapters never seen by any worker are uploaded through the gateway; each is then
asked for twice with the same prompt and sampling: first cold (the worker fetches it from the store and
loads it into its pool on the request's path), at once again warm (resident). Each request carries its
own `cache_salt`, so the warm one finds no cached prefix and computes the same prefill. TTFT is measured
by the client, from the call to the first streamed chunk with tokens: everything the stack does is in it
(the gateway's parse, tokenize and hint, the scheduler, the fetch, the load, the prefill).

A record per (model, rank): cold and warm TTFT p50 / p99, the penalty (cold − warm, per pair) p50 /
p99, and cold p50 ÷ warm p50 (target: ≤ 1.25); and, from the stack's own latency breakdown
(`GenerateResponse.timings`), the p50 of each side's queue (arrival to first scheduled step), adapter
wait (a cold request's fetch and copy, as the worker saw them) and prefill.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from loraserve.bench.common.stack_run import local_stack, upload_messages
from loraserve.bench.common.stats import quantile
from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.launcher.local_stack import LocalStack
from loraserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running through the field "


@dataclass(frozen=True)
class StackSettings:
    ranks: tuple[int, ...]
    trials: int  # cold adapters per rank
    prompt_words: int
    new_tokens: int
    torch_threads: int = 1
    stack_options: tuple[tuple[str, object], ...] = ()  # extra LocalStack options (ablations)


def measure_stack(model_dir: Path, settings: StackSettings) -> list[dict]:
    """One record per rank (see the module docstring); a fresh stack on `model_dir` for all of them."""
    adapters = SyntheticAdapters(model_dir)
    with local_stack(model_dir, torch_threads=settings.torch_threads, **dict(settings.stack_options)) as stack:
        return asyncio.run(_measure(stack, adapters, settings))


async def _measure(stack: LocalStack, adapters: SyntheticAdapters, settings: StackSettings) -> list[dict]:
    prompt = " ".join((PROMPT * (1 + settings.prompt_words // 10)).split()[: settings.prompt_words])
    async with grpc.aio.insecure_channel(stack.address) as channel:
        api = gateway_pb2_grpc.LoraServeStub(channel)
        names = {rank: [f"cold-r{rank}-{i}" for i in range(settings.trials)] for rank in settings.ranks}
        for rank, group in names.items():
            for name in group:
                await api.UploadAdapter(upload_messages(name, *adapters.files(name, rank)), timeout=120)
        await api.UploadAdapter(upload_messages("warm-up", *adapters.files("warm-up", 8)), timeout=120)
        for adapter in ("", "warm-up", "warm-up"):  # lazy initialisation, and one fetch, before any figure
            await _ttft(api, adapter, prompt, settings.new_tokens, f"w{adapter}-{time.monotonic()}")
        records = []
        for rank, group in names.items():
            cold, warm = [], []
            for name in group:
                cold.append(await _ttft(api, name, prompt, settings.new_tokens, f"{name}-cold"))
                warm.append(await _ttft(api, name, prompt, settings.new_tokens, f"{name}-warm"))
            records.append(_record(rank, [c for c, _ in cold], [w for w, _ in warm]) | _phases(cold, warm))
        return records


async def _ttft(
    api: gateway_pb2_grpc.LoraServeStub, adapter: str, prompt: str, new_tokens: int, salt: str
) -> tuple[float, common_pb2.Timings]:
    """Seconds from the call to its first chunk with tokens (greedy, `new_tokens` tokens, its own salt), and
    the stack's latency breakdown of the request."""
    request = gateway_pb2.GenerateRequest(
        adapter=adapter,
        text=prompt,
        max_new_tokens=new_tokens,
        sampling=common_pb2.SamplingParameters(ignore_eos=True),
        cache_salt=salt,
    )
    start = time.perf_counter()
    first, timings = None, common_pb2.Timings()
    async for event in api.GenerateStream(request, timeout=120):
        if first is None and event.HasField("chunk") and event.chunk.token_ids:
            first = time.perf_counter() - start
        if event.HasField("summary"):
            timings = event.summary.timings
    if first is None:
        raise RuntimeError(f"no token came back for {adapter!r}")
    return first, timings


def _phases(cold: list[tuple[float, common_pb2.Timings]], warm: list[tuple[float, common_pb2.Timings]]) -> dict:
    """p50 ms of each side's queue, adapter wait and prefill, as the stack measured them."""
    out = {}
    for side, pairs in (("cold", cold), ("warm", warm)):
        for phase in ("queue_s", "adapter_load_s", "prefill_s"):
            median = statistics.median(getattr(t, phase) for _, t in pairs)
            out[f"{side}_{phase.removesuffix('_s')}_p50_ms"] = round(median * 1e3, 2)
    return out


def _record(rank: int, cold: list[float], warm: list[float]) -> dict:
    penalty = [c - w for c, w in zip(cold, warm, strict=True)]
    return {
        "rank": rank,
        "trials": len(cold),
        "cold_p50_ms": quantile(cold, 0.5, 2, 1e3),
        "cold_p99_ms": quantile(cold, 0.99, 2, 1e3),
        "warm_p50_ms": quantile(warm, 0.5, 2, 1e3),
        "warm_p99_ms": quantile(warm, 0.99, 2, 1e3),
        "penalty_p50_ms": quantile(penalty, 0.5, 2, 1e3),
        "penalty_p99_ms": quantile(penalty, 0.99, 2, 1e3),
        "cold_over_warm_p50": round(statistics.median(cold) / statistics.median(warm), 3),
    }
