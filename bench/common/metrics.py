"""Serving metrics from request records (S-LoRA §7.1): throughput, latencies, SLO attainment.

makespan        last finish - first arrival (trace clock)
req_per_s       finished requests / makespan
tokens_per_s    output tokens of finished requests / makespan (the same window as req_per_s)
ttft            first token - arrival                       (requests that got a first token)
tpot            (finish - first token) / (output tokens - 1)  (finished requests, >= 2 tokens)
latency         finish - arrival                            (finished requests)
slo_attainment  share of ALL requests whose first token came within `slo_s`: a request that
                never got one (failed, or cut off at the deadline) misses
"""

from __future__ import annotations

from loraserve.bench.common.stats import distribution
from loraserve.bench.systems.base import RequestRecord


def summarize(records: list[RequestRecord], slo_s: float) -> dict:
    finished = [r for r in records if r.finished]
    makespan = max(r.finish_s for r in finished) - min(r.arrival_s for r in records) if finished else 0.0
    tokens = sum(r.output_tokens for r in records)
    finished_tokens = sum(r.output_tokens for r in finished)
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    out = {
        "requests": len(records),
        "finished": len(finished),
        "failed": sum(1 for r in records if r.error is not None),
        "output_tokens": tokens,
        "makespan_s": round(makespan, 4),
        "req_per_s": round(len(finished) / makespan, 4) if makespan > 0 else 0.0,
        "tokens_per_s": round(finished_tokens / makespan, 2) if makespan > 0 else 0.0,
    }
    out |= distribution("ttft", ttft, 6)
    out |= distribution("tpot", [r.tpot_s for r in finished if r.tpot_s is not None], 6)
    out |= distribution("latency", [r.latency_s for r in finished], 6)
    out["slo_s"] = slo_s
    out["slo_attainment"] = round(sum(t <= slo_s for t in ttft) / len(records), 4) if records else 0.0
    return out
