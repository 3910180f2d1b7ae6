"""The prefix suite's on/off ratios and its targets, computed from its records: what `results.json` says
was met or missed.

Targets: on multi-turn chat, the cache makes the median time to first token at least 3× lower and
throughput at least 1.5× higher, and leaves the p99 time to first token no higher; where nothing
repeats (unique prompts) it costs at most 3 %, in throughput and in p99 time to first token.
"""

from __future__ import annotations

from loraserve.bench.common.results import judged
from loraserve.bench.common.stats import ratio


def ratios(records: list[dict]) -> dict[str, float | None]:
    """Per workload: TTFT p50 and latency p50 speed-ups (off ÷ on); throughput, TTFT p99, latency p99
    and the p99 of the tokens computed ahead of a first token, on ÷ off."""
    by = {(r["workload"], r["cache"]): r for r in records}
    out = {}
    for workload in dict.fromkeys(r["workload"] for r in records):
        on, off = by[workload, "on"], by[workload, "off"]
        out[f"{workload}_ttft_p50_speedup"] = ratio(off["ttft_p50_s"], on["ttft_p50_s"])
        out[f"{workload}_throughput_ratio"] = ratio(on["tokens_per_s"], off["tokens_per_s"])
        out[f"{workload}_ttft_p99_ratio"] = ratio(on["ttft_p99_s"], off["ttft_p99_s"])
        out[f"{workload}_latency_p50_speedup"] = ratio(off["latency_p50_s"], on["latency_p50_s"])
        out[f"{workload}_latency_p99_ratio"] = ratio(on["latency_p99_s"], off["latency_p99_s"])
        out[f"{workload}_tokens_ahead_p99_ratio"] = ratio(on["tokens_ahead_p99"], off["tokens_ahead_p99"])
    return out


def targets(summary: dict[str, float | None]) -> list[dict]:
    """The suite's targets from `ratios`' summary, each `{"name", "goal", "value", "met"}`."""
    wanted = [
        ("multi-turn TTFT p50, cache off / on", "multi-turn_ttft_p50_speedup", ">= 3"),
        ("multi-turn throughput, cache on / off", "multi-turn_throughput_ratio", ">= 1.5"),
        ("multi-turn TTFT p99, cache on / off", "multi-turn_ttft_p99_ratio", "<= 1.0"),
        ("unique throughput, cache on / off", "unique_throughput_ratio", ">= 0.97"),
        ("unique TTFT p99, cache on / off", "unique_ttft_p99_ratio", "<= 1.03"),
    ]
    rounded = {k: None if v is None else round(v, 3) for k, v in summary.items()}  # judged as the docs show it
    return [judged(name, goal, rounded.get(key)) for name, key, goal in wanted]
