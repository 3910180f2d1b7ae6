"""Percentiles of measured values, rounded, as every suite reports them.

quantile([0.1, 0.2, 0.4], 0.99, digits=4)   # linear interpolation (numpy's default); None when empty
quantile(seconds, 0.5, 2, scale=1e3)        # the same in milliseconds, rounded to 0.01 ms
distribution("ttft", values, digits=6)      # {"ttft_mean_s", "ttft_p50_s", "ttft_p99_s"}
ratio(after, before, digits=3)              # None when either is missing or `before` is 0
median_seconds(fn, repeats=5)               # the median wall time of a call, after a warm-up call
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np


def quantile(values: Sequence[float], q: float, digits: int, scale: float = 1.0) -> float | None:
    """The q-quantile (0 <= q <= 1) of `values` times `scale`, rounded to `digits`; None when there are none."""
    if len(values) == 0:
        return None
    return round(float(np.quantile(np.asarray(values, dtype=np.float64), q)) * scale, digits)


def distribution(name: str, values: Sequence[float], digits: int, mean: bool = True) -> dict[str, float | None]:
    """{name_mean_s (when `mean`), name_p50_s, name_p99_s} of `values`, rounded; Nones when empty."""
    out: dict[str, float | None] = {}
    if mean:
        out[f"{name}_mean_s"] = round(float(np.mean(values)), digits) if len(values) else None
    out[f"{name}_p50_s"] = quantile(values, 0.5, digits)
    out[f"{name}_p99_s"] = quantile(values, 0.99, digits)
    return out


def ratio(a: float | None, b: float | None, digits: int | None = None) -> float | None:
    """a ÷ b, rounded to `digits` (None: not rounded); None when a is None or b is None or 0."""
    if a is None or not b:
        return None
    return a / b if digits is None else round(a / b, digits)


def median_seconds(fn: Callable[[], object], repeats: int, sync: Callable[[], object] = lambda: None) -> float:
    """Median seconds of `fn` over `repeats` calls, after one untimed call; each call is timed until `sync()`
    returns (e.g. torch.cuda.synchronize: until the device is done too)."""
    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
