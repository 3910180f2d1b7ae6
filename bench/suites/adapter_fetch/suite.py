"""Adapter fetch latency, store → worker, over loopback ZMQ (the target: ≤ 20 ms at 7B shapes).

    loraserve bench --suite adapter-fetch [--iterations 30] [--rank 16] [--modules q_proj k_proj v_proj o_proj]
        [--transport tcp ipc] [--torch-threads 1] [--out DIR]

Writes a temporary model directory holding only a Llama-7B-shaped config.json (32 layers, hidden
4096) and a synthetic PEFT adapter (random fp16 lora_A [r, 4096] / lora_B [4096, r] per targeted
projection; rank 16 on q/k/v/o is 33.6 MB), starts `loraserve adapter-store` as a real process
(`bench/common/stack_run.py`) with --preload, then fetches the adapter N times with the workers' AdapterFetcher:

    transfer           fetch() alone: request, the store's lookup, the bytes over loopback TCP
    transfer + parse   fetch() + load_adapter_bytes(): what a worker pays before the adapter can
                       be copied into its pool (safetensors parse, shape and NaN checks)

Reports median / p90 milliseconds and GB/s (10^9 bytes per second) over the adapter's bytes, per
transport (loopback TCP, the default stack's, and a unix socket), each against its own store process.

results.json: a record per transport and phase, and per transport the target, median transfer ≤ --target-ms.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from loraserve.adapter_config import PARENT
from loraserve.adapter_store.client import AdapterFetcher
from loraserve.bench.common.llama7b_files import write_adapter, write_model
from loraserve.bench.common.results import judged, publish
from loraserve.bench.common.stack_run import ADAPTER_NAME, store_process
from loraserve.config_cli import setting
from loraserve.worker.adapters import load_adapter_bytes


@dataclass(frozen=True)
class Result:
    phase: str  # transfer | transfer+parse
    iterations: int
    megabytes: float
    median_ms: float
    p90_ms: float
    min_ms: float
    median_gbps: float


def measure(run: Callable[[], int], iterations: int) -> tuple[list[float], int]:
    """Seconds per call of `run` (which returns the bytes it moved), and those bytes."""
    samples, nbytes = [], 0
    for _ in range(iterations):
        start = time.perf_counter()
        nbytes = run()
        samples.append(time.perf_counter() - start)
    return samples, nbytes


def summarize(phase: str, samples: list[float], nbytes: int) -> Result:
    ordered = sorted(samples)
    median = statistics.median(ordered)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return Result(phase, len(samples), nbytes / 1e6, median * 1e3, p90 * 1e3, ordered[0] * 1e3, nbytes / median / 1e9)


def run_benchmark(args: argparse.Namespace, workdir: Path) -> tuple[list[Result], float]:
    model = write_model(workdir / "model")
    write_adapter(workdir / "adapter", model, args.rank, args.modules)
    with (
        store_process(workdir / "model", workdir / "adapter", workdir, args.transport) as data_address,
        closing(AdapterFetcher(data_address, timeout_s=30.0)) as fetcher,
    ):
        return _fetches(fetcher, model, args)


def _fetches(fetcher: AdapterFetcher, model, args: argparse.Namespace) -> tuple[list[Result], float]:
    """The first fetch's milliseconds, then the timed transfers and transfers with parsing."""

    def transfer() -> int:
        config_json, weights, _ = fetcher.fetch(ADAPTER_NAME, 1)
        return len(config_json) + len(weights)

    def transfer_and_parse() -> int:
        config_json, weights, fmt = fetcher.fetch(ADAPTER_NAME, 1)
        load_adapter_bytes(config_json, weights, model, args.rank, fmt)
        return len(config_json) + len(weights)

    start = time.perf_counter()
    transfer()  # connects the socket
    first_ms = (time.perf_counter() - start) * 1e3
    measure(transfer, args.warmup)
    results = [summarize("transfer", *measure(transfer, args.iterations))]
    measure(transfer_and_parse, 1)
    results.append(summarize("transfer+parse", *measure(transfer_and_parse, args.iterations)))
    return results, first_ms


def print_table(transport: str, results: list[Result], first_ms: float) -> None:
    print(f"{transport}: {'phase':<16}{'n':>5}{'MB':>8}{'median ms':>11}{'p90 ms':>9}{'min ms':>9}{'GB/s':>8}")
    for r in results:
        print(
            f"{transport}: {r.phase:<16}{r.iterations:>5}{r.megabytes:>8.1f}{r.median_ms:>11.2f}{r.p90_ms:>9.2f}"
            f"{r.min_ms:>9.2f}{r.median_gbps:>8.2f}"
        )
    print(f"{transport}: first fetch (connect + transfer) {first_ms:.2f} ms")


def records(transport: str, results: list[Result], first_ms: float) -> list[dict]:
    """results.json's records for one transport's run."""
    return [{"transport": transport, "first_fetch_ms": round(first_ms, 3), **asdict(r)} for r in results]


def targets(rows: list[dict], target_ms: float) -> list[dict]:
    """Per transport: the median transfer (fetch alone) within target_ms."""
    name = "median transfer of the 7B-shaped adapter, {} (ms)"
    return [
        judged(name.format(r["transport"]), f"<= {target_ms:g}", r["median_ms"])
        for r in rows
        if r["phase"] == "transfer"
    ]


@dataclass(frozen=True)
class AdapterFetchSettings:
    """The adapter-fetch suite's flags (its own alone)."""

    iterations: int = setting(30, "timed fetches")
    warmup: int = setting(3, "untimed fetches first")
    rank: int = setting(16, "the adapter's rank")
    modules: tuple[str, ...] = setting(
        ("q_proj", "k_proj", "v_proj", "o_proj"), "the adapter's target modules", nargs="+", choices=list(PARENT)
    )
    transport: tuple[str, ...] = setting(
        ("tcp", "ipc"), "loopback TCP (the default stack's) and/or a unix socket", nargs="+", choices=["tcp", "ipc"]
    )
    target_ms: float = setting(20.0, "the target for one fetch, in milliseconds")
    torch_threads: int = setting(
        1,
        "intra-op threads for parsing (a worker parses on one fetch thread; on a shared CPU, more threads "
        "stall in parallel regions)",
    )
    out: Path | None = setting(None, "write DIR/results.json")


SETTINGS = AdapterFetchSettings


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.torch_threads)
    rows: list[dict] = []
    for transport in args.transport:
        run = argparse.Namespace(**{**vars(args), "transport": transport})
        with tempfile.TemporaryDirectory(prefix="loraserve-bench-") as tmp:
            results, first_ms = run_benchmark(run, Path(tmp))
        print_table(transport, results, first_ms)
        rows += records(transport, results, first_ms)
    settings = {k: v for k, v in vars(args).items() if k in AdapterFetchSettings.__dataclass_fields__}
    verdicts = targets(rows, args.target_ms)
    publish(args.out, "adapter-fetch", rows, args.torch_threads, targets=verdicts, settings=settings)
    return 0
