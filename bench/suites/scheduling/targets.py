"""The scheduling suite's comparisons with fcfs and its targets, computed from its records: what
`results.json` says was met or missed.

`add_ratios` puts on each default-policy record its figures over fcfs's record of the same scenario,
tenant and run (None where one side has no value: the comparison is then missed, not dropped);
`targets` turns them into the suite's targets.
"""

from __future__ import annotations

from loraserve.bench.common.results import judged
from loraserve.bench.common.stats import ratio

NO_WORSE = 0.95  # the default policy's completed requests and req/s, at least this × fcfs's
NO_WORSE_LATENCY = 1.05  # its TTFT p50 and p99, at most this × fcfs's
MORE_REFUSED = 0.05  # it may refuse at most this share of the requests sent more than fcfs does


def _key(record: dict) -> tuple:
    return (record["scenario"], record.get("tenant"), record.get("flood"))


def add_ratios(records: list[dict]) -> None:
    """On each default-policy record with prefetch on: fcfs p99 / its p99 (improvement), its p50 and p99
    over fcfs's, its req/s and completed requests over fcfs's, its refused requests beyond fcfs's as a
    share of those sent; and on one with prefetch off, its load wait over prefetch on's. Where fcfs has a
    record, the p50, p99 and req/s comparisons are always set: None when a side has no value (e.g. the
    default policy completed nothing)."""
    baseline = {_key(r): r for r in records if r["role"] == "baseline"}
    prefetching = {_key(r): r for r in records if r["role"] == "default" and r["prefetch"]}
    for r in records:
        if r["role"] != "default":
            continue
        if not r["prefetch"]:
            on = prefetching.get(_key(r))
            if on is not None and on["load_wait_s"] > 0:
                r["load_wait_vs_prefetch"] = round(r["load_wait_s"] / on["load_wait_s"], 3)
            continue
        b = baseline.get(_key(r))
        if b is None:
            continue
        if (improvement := ratio(b["ttft_p99_s"], r["ttft_p99_s"], 3)) is not None:
            r["ttft_p99_improvement_vs_fcfs"] = improvement
        r["ttft_p99_vs_fcfs"] = ratio(r["ttft_p99_s"], b["ttft_p99_s"], 4)
        r["ttft_p50_vs_fcfs"] = ratio(r["ttft_p50_s"], b["ttft_p50_s"], 4)
        r["req_per_s_vs_fcfs"] = ratio(r["req_per_s"], b["req_per_s"], 4)
        r["fcfs_completed"], r["fcfs_refused"] = b["completed"], b["refused"]
        if b["completed"]:
            r["completed_vs_fcfs"] = round(r["completed"] / b["completed"], 4)
        if r["n_requests"]:
            r["refused_beyond_fcfs"] = round((r["refused"] - b["refused"]) / r["n_requests"], 4)


def targets(records: list[dict]) -> list[dict]:
    """The scheduling targets, each {name, goal, value, met}, for the scenarios the records cover."""

    def find(scenario: str, prefetch: bool = True, **tags) -> dict | None:
        wanted = {"scenario": scenario, "role": "default", "prefetch": prefetch, **tags}
        return next((r for r in records if all(r.get(k) == v for k, v in wanted.items())), None)

    out = []
    if (ht := find("heavy-tail")) is not None:
        out.append(judged("heavy-tail p99 TTFT, fcfs / default", ">= 3", ht.get("ttft_p99_improvement_vs_fcfs")))
    flooded, calm = find("flood", tenant="victim", flood=True), find("flood", tenant="victim", flood=False)
    if flooded is not None and calm is not None:
        value = ratio(flooded["ttft_p99_s"], calm["ttft_p99_s"], 3)
        out.append(judged("victim p99 TTFT, flood / calm (default policy)", "<= 1.5", value))
    for scenario in ("conversations", "popularity"):
        off = find(scenario, prefetch=False)
        if off is not None and "load_wait_vs_prefetch" in off:
            out.append(judged(f"{scenario} load wait, prefetch off / on", ">= 5", off["load_wait_vs_prefetch"]))
    if (conv := find("conversations")) is not None:
        out.append(judged("conversations prefetch hit rate (default policy)", ">= 0.5", conv["prefetch_hit_rate"]))
    if flooded is not None and (b := _baseline_of(records, flooded)) is not None:
        mine, theirs = flooded.get("slo_attainment"), b.get("slo_attainment")
        value = None if mine is None or theirs is None else round(mine - theirs, 4)
        out.append(judged("flood (victim, flooded) SLO attainment, default − fcfs", ">= 0", value))
    for r in records:
        if r["role"] != "default" or not r["prefetch"] or r.get("tenant") == "flooder":
            continue
        checks = [
            ("ttft_p50_vs_fcfs", "TTFT p50, default / fcfs", f"<= {NO_WORSE_LATENCY}"),
            ("ttft_p99_vs_fcfs", "TTFT p99, default / fcfs", f"<= {NO_WORSE_LATENCY}"),
            ("req_per_s_vs_fcfs", "req/s, default / fcfs", f">= {NO_WORSE}"),
        ]
        if r.get("whole_run"):  # every tenant of the run: what was served and what was turned away
            checks += [
                ("completed_vs_fcfs", "completed, default / fcfs", f">= {NO_WORSE}"),
                ("refused_beyond_fcfs", "refused, (default − fcfs) / sent", f"<= {MORE_REFUSED}"),
            ]
        for key, what, goal in checks:
            if key in r:  # set by add_ratios wherever fcfs has a record (None: a side has no value)
                out.append(judged(f"{_label(r)} {what}", goal, r[key]))
    return out


def _label(r: dict) -> str:
    """A record's name in the targets: its scenario, and for the flood its tenant and run."""
    tenant = r.get("tenant")
    if tenant is None:
        return r["scenario"]
    if tenant == "all":
        return f"{r['scenario']} (every tenant, flooded)"
    return f"{r['scenario']} ({tenant}, {'flooded' if r.get('flood') else 'alone'})"


def _baseline_of(records: list[dict], record: dict) -> dict | None:
    """fcfs's record of the same scenario, tenant and run as `record`."""
    return next((r for r in records if r["role"] == "baseline" and _key(r) == _key(record)), None)
