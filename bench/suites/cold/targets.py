"""The cold suite's targets, computed from its records: what `results.json` says was met or missed.

- per model, a cold request's p50 TTFT within TARGET_COLD_OVER_WARM × the same request warm, at every
  rank (the value is the highest ratio over the ranks measured);
- same-host fetch + load of the 7B-shaped adapter (rows in shared memory) at ≥ TARGET_FRACTION_OF_MEMCPY
  of the memcpy bandwidth measured beside it.

A part not run has none.
"""

from __future__ import annotations

from loraserve.bench.common.results import judged

TARGET_COLD_OVER_WARM = 1.25  # cold p50 TTFT ≤ 1.25 × warm
TARGET_FRACTION_OF_MEMCPY = 0.5  # same-host fetch + load ≥ 50 % of memcpy bandwidth
SAME_HOST_PATH = "rows-shm"


def targets(records: list[dict]) -> list[dict]:
    out = []
    stack = [r for r in records if r["part"] == "stack"]
    for model in dict.fromkeys(r["model"] for r in stack):
        worst = max(r["cold_over_warm_p50"] for r in stack if r["model"] == model)
        name = f"cold ÷ warm p50 TTFT, {model}, highest over ranks"
        out.append(judged(name, f"<= {TARGET_COLD_OVER_WARM}", worst))
    load = next((r for r in records if r["part"] == "load" and r["path"] == SAME_HOST_PATH), None)
    if load is not None:
        name = "7B-shaped adapter fetch + load in shared memory, fraction of memcpy"
        out.append(judged(name, f">= {TARGET_FRACTION_OF_MEMCPY}", load["fraction_of_memcpy"]))
    return out
