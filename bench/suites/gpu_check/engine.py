"""GPU suite, part 3: the engine on a 7B-shaped random model against the base model and two baselines.

Every system serves the same S-LoRA trace offline — all requests arrive at once (a Gamma process
squeezed into 50 ms), adapters by power-law popularity (α = 1), ranks round-robin from 64/32/16/8,
EOS ignored — so each one runs as fast as it can and its throughput is its capacity:

    loraserve n = 1, 100, 1000   the engine (Triton backend), n adapters registered
    base                         the same requests as n = 1 with no adapter: the LoRA overhead
    peft, merge-and-swap         at n = baseline_adapters, with loraserve on that same trace

Throughput = output tokens of finished requests / makespan (bench/common/metrics.py). A run is cut at a
time cap; the requests it finished still count (the row says how many). n adapters share a few
weight sets per rank: each is still registered, loaded into the pool and evicted as its own adapter,
and speed does not depend on the values.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import time
import zlib
from pathlib import Path

import torch

from loraserve.bench.common.metrics import summarize
from loraserve.bench.common.random_model import write_once
from loraserve.bench.common.stats import ratio
from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.bench.suites.gpu_check.preset import GpuPreset
from loraserve.bench.suites.gpu_check.profile import profile_decode
from loraserve.bench.systems.base import ReplayLimits
from loraserve.bench.systems.engine import AdapterBank, EngineSystem
from loraserve.bench.workloads.slora import Trace, WorkloadSpec, synthetic_trace
from loraserve.worker.adapters import LoraAdapter
from loraserve.worker.config import EngineConfig

ARRIVAL_WINDOW_S = 0.05
KEYS = ("requests", "finished", "output_tokens", "makespan_s", "req_per_s", "tokens_per_s", "ttft_p50_s", "tpot_p50_s")
STATS = ("mean_batch_size", "steps", "adapter_loads", "adapter_evictions", "prefetch_hit_rate", "adapter_load_s")
STATS += ("adapter_switches", "mean_switch_ms", "setup_s")  # the baselines'


class SharedWeightsBank(AdapterBank):
    """An AdapterBank whose n adapters reuse `distinct` weight sets per rank (host RAM and set-up time
    stay small at n = 1000 and 7B shapes; each name is still its own adapter in the engine)."""

    def __init__(self, adapters: SyntheticAdapters, distinct: int):
        super().__init__(adapters)
        self.distinct = distinct

    def get(self, name: str, rank: int) -> LoraAdapter:
        return super().get(f"weights-{zlib.crc32(name.encode()) % self.distinct}", rank)


def model_dir(preset: GpuPreset, work: Path) -> tuple[Path, float]:
    """The preset's random checkpoint under `work` (written once); returns it and seconds spent writing."""
    start = time.perf_counter()
    path = work / f"llama-{preset.shape.hidden}x{preset.shape.layers}-{preset.dtype}"
    write_once(path, preset.shape, dtype=preset.torch_dtype, device=preset.device)
    return path, time.perf_counter() - start


def offline_trace(preset: GpuPreset, n_adapters: int, seed: int = 0) -> Trace:
    spec = WorkloadSpec(
        n_adapters=n_adapters,
        alpha=1.0,
        rate=preset.requests / ARRIVAL_WINDOW_S,
        cv=1.0,
        duration_s=ARRIVAL_WINDOW_S,
        input_len=preset.input_len,
        output_len=preset.output_len,
        ranks=preset.ranks,
        seed=seed,
    )
    return synthetic_trace(spec)


def without_adapters(trace: Trace) -> Trace:
    """The same requests for the base model alone."""
    requests = tuple(dataclasses.replace(r, adapter=None) for r in trace.requests)
    return Trace(requests, {}, {**trace.params, "adapters": "none"})


def engine_config(preset: GpuPreset) -> EngineConfig:
    return EngineConfig(
        device=preset.device,
        dtype=preset.dtype,
        backend=preset.backend,
        max_batch_size=preset.max_batch_size,
        pool_pages=None if preset.device == "cuda" else 2048,
    )


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(system, trace: Trace, label: str, n_adapters: int) -> dict:
    start = time.perf_counter()
    try:
        records = system.run(trace)
    except Exception as e:  # one system failing must not lose the others' figures
        return {"system": label, "n_adapters": n_adapters, "error": f"{type(e).__name__}: {e}"}
    finally:
        free_device_memory()
    summary = summarize(records, slo_s=6.0)
    stats = system.stats()
    used = len({r.adapter for r in trace.requests if r.adapter is not None})
    row = {"system": label, "n_adapters": n_adapters, "adapters_used": used}
    row |= {k: summary[k] for k in KEYS} | {k: stats[k] for k in STATS if k in stats}
    return row | {"wall_s": round(time.perf_counter() - start, 2)}


def run(preset: GpuPreset, work: Path, log=print, partial=lambda data: None) -> dict:
    """Every system on its trace; returns {"model", "workload", "rows", "ratios", "decode_profile",
    "graph_speedup"}.

    `partial(data)` gets the figures so far after every row, so a run cut at its time limit keeps them.
    """
    path, write_s = model_dir(preset, work)
    log(f"model {path} ({preset.shape.parameters / 1e9:.2f}B parameters, written in {write_s:.1f} s)")
    adapters = SyntheticAdapters(path, dtype=preset.torch_dtype)
    bank = SharedWeightsBank(adapters, preset.distinct_weights)
    engine_limits = ReplayLimits(drain_s=preset.engine_cap_s, progress=False)
    loraserve = EngineSystem("loraserve", path, engine_config(preset), bank, engine_limits)
    data = {
        "model": {
            "path": str(path),
            "shape": dataclasses.asdict(preset.shape),
            "dtype": preset.dtype,
            "parameters": preset.shape.parameters,
            "write_s": round(write_s, 1),
        },
        "workload": {
            "requests": preset.requests,
            "input_len": preset.input_len,
            "output_len": preset.output_len,
            "alpha": 1.0,
            "ranks": preset.ranks,
            "max_batch_size": preset.max_batch_size,
        },
        "rows": [],
        "ratios": ratios([], preset),
        "decode_profile": [],
        "graph_speedup": None,
    }

    def record(row: dict) -> None:
        data["rows"].append(row)
        data["ratios"] = ratios(data["rows"], preset)
        log(" ".join(f"{k}={v}" for k, v in row.items()))
        partial(data)

    traces = {n: offline_trace(preset, n) for n in {*preset.adapter_counts, preset.baseline_adapters}}
    first = min(preset.adapter_counts)
    record(measure(loraserve, without_adapters(traces[first]), "base", 0))
    for n in sorted(traces):
        record(measure(loraserve, traces[n], "loraserve", n))
    n = preset.baseline_adapters
    baseline_limits = ReplayLimits(drain_s=preset.baseline_cap_s, progress=False)
    from loraserve.bench.systems.merge import MergeSwapSystem
    from loraserve.bench.systems.peft import PeftSystem

    on_device = {"device": preset.device, "dtype": preset.torch_dtype}
    peft = PeftSystem(adapters, work / "adapters", preset.max_batch_size, baseline_limits, **on_device)
    record(measure(peft, traces[n], "peft", n))
    del peft
    merge = MergeSwapSystem(adapters, preset.max_batch_size, baseline_limits, **on_device)
    record(measure(merge, traces[n], "merge-and-swap", n))
    del merge
    free_device_memory()
    # on CUDA each with decode steps replayed from CUDA graphs and all eager (--enforce-eager)
    modes = ("auto", "off") if preset.device == "cuda" else ("off",)
    for count, graphs in itertools.product((0, max(preset.adapter_counts)), modes):
        config = dataclasses.replace(engine_config(preset), cuda_graphs=graphs)
        try:
            profile = profile_decode(path, config, bank, count, preset.ranks)
        except Exception as e:  # the profile explains the figures; its failure must not lose them
            profile = {"n_adapters": count, "cuda_graphs": graphs, "error": f"{type(e).__name__}: {e}"}
        data["decode_profile"].append(profile)
        data["graph_speedup"] = graph_speedup(data["decode_profile"], max(preset.adapter_counts))
        free_device_memory()
        log(f"decode-step profile: {profile}")
        partial(data)
    return data


def graph_speedup(profiles: list[dict], n_adapters: int) -> float | None:
    """Eager decode-step wall time / with CUDA graphs, at `n_adapters`; None until both are measured."""
    wall = {
        p["cuda_graphs"]: p["wall_ms_per_step"] for p in profiles if p["n_adapters"] == n_adapters and "error" not in p
    }
    return round(wall[False] / wall[True], 3) if True in wall and False in wall else None


def _throughput(rows: list[dict], system: str, n: int) -> float | None:
    row = next((r for r in rows if r["system"] == system and r["n_adapters"] == n and "error" not in r), None)
    return row["tokens_per_s"] if row and row["tokens_per_s"] else None


def ratios(rows: list[dict], preset: GpuPreset) -> dict[str, float | int | None]:
    """high_over_low: throughput at the most adapters / at the fewest; lora_overhead: 1 - throughput
    with the fewest adapters / the base model's on the same requests; over_peft, over_merge_and_swap:
    loraserve's throughput / the baseline's at baseline_n adapters, on the same trace."""

    low, high, nb = min(preset.adapter_counts), max(preset.adapter_counts), preset.baseline_adapters
    ls = lambda n: _throughput(rows, "loraserve", n)  # noqa: E731
    with_lora = ratio(ls(low), _throughput(rows, "base", 0), 3)
    return {
        "low": low,
        "high": high,
        "baseline_n": nb,
        "high_over_low": ratio(ls(high), ls(low), 3),
        "lora_overhead": None if with_lora is None else round(1 - with_lora, 3),
        "over_peft": ratio(ls(nb), _throughput(rows, "peft", nb), 3),
        "over_merge_and_swap": ratio(ls(nb), _throughput(rows, "merge-and-swap", nb), 3),
    }
