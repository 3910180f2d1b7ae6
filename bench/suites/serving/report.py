"""The serving suite's report: the table of every system and setting, and the ratios that matter."""

from __future__ import annotations

from loraserve.bench.common import stats
from loraserve.bench.common.results import judged
from loraserve.bench.common.tables import rich_table, wide_console
from loraserve.bench.systems.engine import LORASERVE_VARIANTS

BASELINES = ("peft", "merge-and-swap")
STACK = "loraserve-stack"  # the same engine behind the gRPC services, as real processes
TARGET_N = 100  # the targets' adapter count: S-LoRA's many-adapter case
PEFT_GOAL = 5.0  # loraserve's throughput over peft's, at TARGET_N adapters
# the table's columns, title -> the row's key: the setting, throughput, latencies, outcome, the systems' own figures
COLUMNS = {"system": "system", "n": "n_adapters", "rate": "rate", "req/s": "req_per_s", "tok/s": "tokens_per_s"}
COLUMNS |= {"ttft p50": "ttft_p50_s", "ttft p99": "ttft_p99_s", "tpot p50": "tpot_p50_s", "latency": "latency_mean_s"}
COLUMNS |= {"SLO": "slo_attainment", "done": "finished", "batch": "mean_batch_size", "waste": "pool_waste_fraction"}
COLUMNS |= {"loads": "adapter_loads", "prefetch hit": "prefetch_hit_rate", "switches": "adapter_switches"}


def _row(rows: list[dict], system: str, n: int, rate: float) -> dict | None:
    return next((r for r in rows if r["system"] == system and r["n_adapters"] == n and r["rate"] == rate), None)


def ratios(rows: list[dict], rate: float) -> list[tuple[str, float | None]]:
    """(description, value): throughput ratios at `rate` (and mean-latency ratios where they help)."""

    def ratio(a: dict | None, b: dict | None, key: str = "req_per_s") -> float | None:
        return stats.ratio((a or {}).get(key), (b or {}).get(key), 3)

    out = []
    for n in (100, 1):
        ls = _row(rows, "loraserve", n, rate)
        for other in BASELINES:
            o = _row(rows, other, n, rate)
            out.append((f"loraserve / {other} throughput, n={n}", ratio(ls, o)))
            out.append((f"{other} / loraserve mean latency, n={n}", ratio(o, ls, "latency_mean_s")))
    ns = sorted({r["n_adapters"] for r in rows if r["system"] == "loraserve" and r["rate"] == rate})
    if len(ns) > 1:
        top, bottom = _row(rows, "loraserve", ns[-1], rate), _row(rows, "loraserve", ns[0], rate)
        out.append((f"loraserve throughput n={ns[-1]} / n={ns[0]}", ratio(top, bottom)))
        offered = ratio(top, bottom, "offered_req_per_s")
        out.append((f"  offered load n={ns[-1]} / n={ns[0]} (the traces differ)", offered))
        out.append((f"  mean latency n={ns[-1]} / n={ns[0]}", ratio(top, bottom, "latency_mean_s")))
        out.append((f"loraserve output tok/s n={ns[-1]} / n={ns[0]}", ratio(top, bottom, "tokens_per_s")))
    for n in ns:
        stack, ls = _row(rows, STACK, n, rate), _row(rows, "loraserve", n, rate)
        out.append((f"{STACK} / loraserve (in-process) throughput, n={n}", ratio(stack, ls)))
        if stack and ls and stack.get("tpot_p50_s") is not None and ls.get("tpot_p50_s") is not None:
            added = round(1000 * (stack["tpot_p50_s"] - ls["tpot_p50_s"]), 2)
            out.append((f"{STACK} added latency per token (p50 tpot difference, ms), n={n}", added))
    for variant in LORASERVE_VARIANTS[1:]:
        for n in ns:
            v, ls = _row(rows, variant, n, rate), _row(rows, "loraserve", n, rate)
            r = ratio(v, ls)
            out.append((f"{variant} throughput loss vs loraserve, n={n}", None if r is None else round(1 - r, 3)))
            out.append((f"{variant} / loraserve mean latency, n={n}", ratio(v, ls, "latency_mean_s")))
    return out


def targets(rows: list[dict], rate: float) -> list[dict]:
    """The suite's targets at the adapter sweep's `rate` and TARGET_N adapters, as
    `{"name", "goal", "value", "met"}`: loraserve's throughput at least PEFT_GOAL times peft's, and
    above merge-and-swap's. A system that did not run gives value and met None."""
    ls = _row(rows, "loraserve", TARGET_N, rate)
    out = []
    for other, goal in (("peft", f">= {PEFT_GOAL:g}"), ("merge-and-swap", "> 1")):
        o = _row(rows, other, TARGET_N, rate)
        value = round(ls["req_per_s"] / o["req_per_s"], 3) if ls and o and o.get("req_per_s") else None
        out.append(judged(f"throughput, loraserve / {other}, n = {TARGET_N}, R = {rate:g} req/s", goal, value, None))
    return out


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def print_report(rows: list[dict], rate: float) -> None:
    cells = [[_fmt(row.get(key)) for key in COLUMNS.values()] for row in rows]
    console = wide_console(180)
    console.print(rich_table("loraserve bench", list(COLUMNS), cells, left={"system"}))
    for description, value in ratios(rows, rate):
        if value is not None:
            console.print(f"{description}: {value}")
