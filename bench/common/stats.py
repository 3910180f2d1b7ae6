"""Percentiles of measured values, rounded, as every suite reports them.

quantile([0.1, 0.2, 0.4], 0.99, digits=4)   # linear interpolation (numpy's default); None when empty
distribution("ttft", values, digits=6)      # {"ttft_mean_s", "ttft_p50_s", "ttft_p99_s"}
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def quantile(values: Sequence[float], q: float, digits: int) -> float | None:
    """The q-quantile (0 <= q <= 1) of `values`, rounded to `digits`; None when there are none."""
    if len(values) == 0:
        return None
    return round(float(np.quantile(np.asarray(values, dtype=np.float64), q)), digits)


def distribution(name: str, values: Sequence[float], digits: int, mean: bool = True) -> dict[str, float | None]:
    """{name_mean_s (when `mean`), name_p50_s, name_p99_s} of `values`, rounded; Nones when empty."""
    out: dict[str, float | None] = {}
    if mean:
        out[f"{name}_mean_s"] = round(float(np.mean(values)), digits) if len(values) else None
    out[f"{name}_p50_s"] = quantile(values, 0.5, digits)
    out[f"{name}_p99_s"] = quantile(values, 0.99, digits)
    return out
