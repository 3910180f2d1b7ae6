"""Timing GPU kernels: eager calls (triton's do_bench), one call replayed from a CUDA graph with L2
flushed, the wall clock on CPU (dry runs), and the device's memory bandwidth; and a kernel's output
checked against its reference (`errors`)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# by device-name substring, first match wins: HBM3e / HBM3 (SXM) / PCIe
PEAK_BANDWIDTH_TBS = {"H200": 4.8, "H100 PCIe": 2.0, "H100 NVL": 3.9, "H100": 3.35}
FLUSH_BYTES = 256 << 20  # what triton's do_bench zeroes to flush L2 between runs

Fn = Callable[[], object]
Timer = Callable[[Fn], float]  # fn -> milliseconds
GraphTimer = Callable[[Fn], float | None]  # fn -> milliseconds, None when not measured


@dataclass(frozen=True)
class Timers:
    eager: Timer  # one eager call
    graph: GraphTimer  # device time of one call replayed from a CUDA graph


def default_bandwidth(device_name: str) -> float | None:
    """Datasheet peak bandwidth in TB/s for a known device name, else None."""
    return next((tbs for key, tbs in PEAK_BANDWIDTH_TBS.items() if key in device_name), None)


def _median_ms(starts: list, ends: list) -> float:
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def measure_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Device memory bandwidth in TB/s: 2 * nbytes / t for a copy of nbytes (read + write), median t."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        dst.copy_(src)
        e.record()
    ms = _median_ms(starts, ends)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e12


def _capture(fn: Fn) -> torch.cuda.CUDAGraph:
    """fn once on a side stream (as torch's graph docs ask), then one call captured in a graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def cuda_graph_time_ms(fn: Fn, flush: torch.Tensor, rep_ms: float = 10.0) -> float | None:
    """Median device time of one replay of a graph holding one call of fn; None if capture fails.

    flush (about 256 MiB) is zeroed before each replay so that every replay starts from a cold L2,
    as triton's do_bench does for eager calls; n = clamp(rep_ms / (estimate + 0.1 ms), 5, 100) replays.
    """
    stream = torch.cuda.current_stream()
    try:
        graph = _capture(fn)
    except Exception:  # fn synchronises or copies from host memory: not capturable
        torch.cuda.set_stream(stream)  # a failed capture_end leaves the capture stream current
        torch.cuda.synchronize()
        return None
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    estimate = _median_ms([start], [end]) / 3
    n = max(5, min(100, int(rep_ms / (estimate + 0.1))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends, strict=True):
        flush.zero_()
        s.record()
        graph.replay()
        e.record()
    ms = _median_ms(starts, ends)
    graph.reset()
    return ms


def cuda_timers(device: torch.device, rep_ms: float = 10.0, warmup_ms: float = 5.0) -> Timers:
    """Eager: triton.testing.do_bench (median); graph: cuda_graph_time_ms with one shared flush buffer."""
    import triton.testing

    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    return Timers(
        eager=lambda fn: triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"),
        graph=lambda fn: cuda_graph_time_ms(fn, flush, rep_ms),
    )


def wall_timers() -> Timers:
    """CPU (dry run): one call timed by the wall clock; no graphs."""

    def eager(fn: Fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return Timers(eager=eager, graph=lambda fn: None)


def ms_to_us(ms: float | None) -> float | None:
    return None if ms is None else ms * 1e3


def timed(result: Any, name: str, timer: GraphTimer, fn: Fn) -> float | None:
    """timer(fn) in microseconds; None, and a note in the row, when it runs out of device memory."""
    try:
        return ms_to_us(timer(fn))
    except torch.cuda.OutOfMemoryError:
        result.note = "; ".join(filter(None, [result.note, f"{name}: out of memory"]))
        torch.cuda.empty_cache()
        return None


def errors(out: torch.Tensor, ref: torch.Tensor, atol: float | None = None) -> tuple[float | None, float | None, bool]:
    """(max |out - ref|, ||out - ref||_F / ||ref||_F, ok); Nones and not ok for a non-finite error, 0s for empty
    tensors. ok: rel < 1e-2, or (given `atol`) every element within atol + atol * |ref| (allclose)."""
    diff = (out.float() - ref.float()).abs()
    max_abs = diff.max().item() if diff.numel() else 0.0
    rel = (diff.norm() / ref.float().norm().clamp_min(1e-30)).item() if diff.numel() else 0.0
    if not (math.isfinite(max_abs) and math.isfinite(rel)):
        return None, None, False
    close = atol is not None and bool((diff <= atol + atol * ref.float().abs()).all())
    return max_abs, rel, close or rel < 1e-2
