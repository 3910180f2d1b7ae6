"""GPU suite, part 4: what the services add to the engine, and what moving an adapter costs.

stack vs in-process   one S-LoRA trace in real time, below saturation (rank-16 adapters),
                      through gateway + scheduler + adapter store + one worker as real processes,
                      and through the in-process engine with the same settings; the added
                      latency per token is the difference of the p50 time per output token
adapter fetch         a rank-16 q/k/v/o adapter at 7B shapes (33.6 MB in fp16) from a real
                      adapter-store process to a worker's AdapterFetcher over loopback TCP
                      (`loraserve bench --suite adapter-fetch`)
host to device        the same adapter: packing it into pool rows on the host, pinning, the copy
                      from pageable and from pinned memory, and the worker's whole load path
                      (UnifiedPool.ensure on a miss: pack + pin + copy + scatter into its pages)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from loraserve.bench.common.metrics import summarize
from loraserve.bench.common.results import suite_results
from loraserve.bench.common.stats import median_seconds
from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.bench.suites.gpu_check.engine import engine_config, free_device_memory, model_dir
from loraserve.bench.suites.gpu_check.preset import GpuPreset
from loraserve.bench.systems.base import ReplayLimits
from loraserve.bench.systems.engine import AdapterBank, EngineSystem
from loraserve.bench.systems.stack import StackSystem
from loraserve.bench.workloads.slora import WorkloadSpec, synthetic_trace
from loraserve.model_config import ModelConfig
from loraserve.worker.adapter_cache import AdapterRegistry
from loraserve.worker.pool_layout import PoolLayout
from loraserve.worker.unified_pool import UnifiedPool

FETCH_RANK = 16
FETCH_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
KEYS = ("finished", "requests", "tokens_per_s", "ttft_p50_s", "tpot_p50_s", "tpot_p99_s", "latency_mean_s")


def stack_vs_engine(preset: GpuPreset, path: Path, log=print) -> dict:
    spec = WorkloadSpec(
        n_adapters=preset.stack_adapters,
        alpha=1.0,
        rate=preset.stack_rate,
        cv=1.0,
        duration_s=preset.stack_duration_s,
        input_len=preset.input_len,
        output_len=preset.stack_output_len,
        ranks=(FETCH_RANK,),
        seed=1,
    )
    trace = synthetic_trace(spec)
    adapters = SyntheticAdapters(path, dtype=preset.torch_dtype)
    limits = ReplayLimits(drain_s=60.0, progress=False)
    config = engine_config(preset)
    systems = {
        "in-process": EngineSystem("loraserve", path, config, AdapterBank(adapters), limits),
        "stack": StackSystem(adapters, config.pool_pages, preset.max_batch_size, limits, device=preset.device),
    }
    rows = {}
    for label, system in systems.items():
        start = time.perf_counter()
        summary = summarize(system.run(trace), slo_s=6.0)
        free_device_memory()
        rows[label] = {k: summary[k] for k in KEYS} | {"wall_s": round(time.perf_counter() - start, 1)}
        log(f"{label}: {rows[label]}")
    tpot = [rows[k]["tpot_p50_s"] for k in ("stack", "in-process")]
    ttft = [rows[k]["ttft_p50_s"] for k in ("stack", "in-process")]
    return {
        "requests": len(trace.requests),
        "rate": preset.stack_rate,
        "adapters": preset.stack_adapters,
        "rows": rows,
        "added_tpot_p50_ms": round(1e3 * (tpot[0] - tpot[1]), 3) if None not in tpot else None,
        "added_ttft_p50_ms": round(1e3 * (ttft[0] - ttft[1]), 3) if None not in ttft else None,
    }


def adapter_fetch(preset: GpuPreset, work: Path) -> dict:
    """`loraserve bench --suite adapter-fetch` over loopback TCP at the preset's iterations; its figures."""
    argv = ["--rank", str(FETCH_RANK), "--modules", *FETCH_MODULES, "--transport", "tcp", "--warmup", "2"]
    argv += ["--iterations", str(preset.fetch_iterations), "--torch-threads", str(torch.get_num_threads())]
    records = suite_results("adapter-fetch", work / "adapter-fetch", *argv)["records"]  # this part's threads
    own = ("transport", "first_fetch_ms")
    results = [{k: v for k, v in r.items() if k not in own} for r in records]
    return {"first_fetch_ms": round(records[0]["first_fetch_ms"], 2), "results": results}


def _median_ms(fn: Callable[[], object], iterations: int, sync: bool) -> float:
    """Median milliseconds of `fn` after a warm-up call (with `sync`, until the device is done too)."""
    return round(1e3 * median_seconds(fn, iterations, torch.cuda.synchronize if sync else lambda: None), 3)


def host_to_device(preset: GpuPreset, path: Path) -> dict:
    """Milliseconds per step of moving the rank-16 q/k/v/o adapter into a pool on `preset.device`."""
    model = ModelConfig.from_dir(path)
    adapter = AdapterBank(SyntheticAdapters(path, dtype=preset.torch_dtype)).get("h2d", FETCH_RANK)
    device, dtype = torch.device(preset.device), preset.torch_dtype
    probe = PoolLayout.for_model(model, 32, 1)
    pages = adapter.layout(probe, model).num_pages
    layout = PoolLayout.for_model(model, 32, pages)
    registry = AdapterRegistry()
    key = registry.register("h2d", adapter)
    pool = UnifiedPool(layout, model, registry, dtype, device)
    rows = adapter.pack(layout, model, dtype)
    on_gpu = device.type == "cuda"
    n = preset.fetch_iterations

    def load() -> None:
        pool.ensure(key)  # a miss: copied in now
        pool.make_room(pages)  # evicts it again: the pool holds nothing else

    out = {
        "weights_mb": round(sum(a.numel() + b.numel() for a, b in adapter.weights.values()) * dtype.itemsize / 1e6, 2),
        "pool_rows_mb": round(rows.nbytes / 1e6, 2),
        "pack_ms": _median_ms(lambda: adapter.pack(layout, model, dtype), n, sync=False),
        "worker_load_ms": _median_ms(load, n, sync=on_gpu),
    }
    if on_gpu:
        pinned = rows.pin_memory()
        out |= {
            "pin_ms": _median_ms(rows.pin_memory, n, sync=False),
            "h2d_pageable_ms": _median_ms(lambda: rows.to(device), n, sync=True),
            "h2d_pinned_ms": _median_ms(lambda: pinned.to(device, non_blocking=True), n, sync=True),
        }
        out["h2d_pinned_gbps"] = round(rows.nbytes / out["h2d_pinned_ms"] / 1e6, 2)
    pool.copier.close()
    return out


def run(preset: GpuPreset, work: Path, log=print, partial=lambda data: None) -> dict:
    """Adapter fetch, host-to-device copies, then the stack against the in-process engine;
    `partial(data)` gets the figures so far after each, so a run cut at its time limit keeps them."""
    path, _ = model_dir(preset, work)
    out: dict = {}
    measurements = {
        "adapter_fetch": lambda: adapter_fetch(preset, work),
        "host_to_device": lambda: host_to_device(preset, path),
        "stack_vs_engine": lambda: stack_vs_engine(preset, path, log),
    }
    for name, fn in measurements.items():
        start = time.perf_counter()
        try:
            out[name] = fn()
        except Exception as e:  # one measurement failing must not lose the others
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        log(f"{name} ({time.perf_counter() - start:.1f} s): {out[name]}")
        partial(out)
    return out
