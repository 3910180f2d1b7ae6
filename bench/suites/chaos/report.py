"""The chaos benchmark's records and figures: what each stream and each disruption did, summed up.

Per stream the client records its status, its tokens, the summary's `failovers`, and three
times from the moment the call was made: the first token (ttft), the end (total), and the
largest gap the client waited for its next token (max gap: between the call and the first
token chunk, or between two consecutive chunks), with when that gap began. A failover shows as
one long gap, wherever in the stream it happens. The summary compares the chaos run with the
undisturbed reference of the same requests:

- mismatches: streams that completed OK in both runs with different tokens (must be 0);
- latency of three groups (reference; chaos, not failed over; chaos, failed over), p50/p99;
- added latency: chaos minus reference of the same request, per group (paired, so the
  request's own length and adapter cancel out), and for failed-over streams per disruption
  kind: a stream is attributed to the one disruption signalled during its longest gap
  (`attribute`); one with none or several is left out of the per-kind figures.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from loraserve.bench.common.results import judged, target
from loraserve.bench.common.stats import distribution, ratio
from loraserve.bench.common.tables import rich_table, wide_console

OK = "OK"
LATENCY_KEYS = ("total_p50_s", "total_p99_s", "ttft_p50_s", "ttft_p99_s", "max_gap_p50_s", "max_gap_p99_s")
ADDED_KEYS = ("added_total_p50_s", "added_total_p99_s", "added_max_gap_p50_s", "added_max_gap_p99_s")


@dataclass
class StreamRecord:
    request_id: str
    adapter: str
    sampled: bool
    max_new_tokens: int
    arrival_s: float  # when the call was made, seconds after the phase started
    status: str = ""  # OK or a gRPC status name ("" while unfinished)
    detail: str = ""
    tokens: list[int] = field(default_factory=list)
    failovers: int = 0
    worker_id: str = ""
    ttft_s: float | None = None
    total_s: float | None = None
    max_gap_s: float | None = None
    max_gap_at_s: float | None = None  # when the longest gap began (phase clock)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["tokens"] = len(self.tokens)
        return out


@dataclass
class AppliedDisruption:
    at_s: float  # when it was due, seconds after the chaos phase started
    kind: str
    worker: str | None  # None: skipped (fewer than two workers were serving and undisturbed)
    signalled_s: float | None = None  # when the signal was sent (phase clock)
    recovery_s: float | None = None  # from the signal until the worker served again
    exit_code: int | None = None  # of the victim, for kill and term


def max_gap(start: float, chunk_times: list[float]) -> tuple[float, float] | None:
    """(length, start) of the longest wait for a token chunk from the call's `start` on (None
    without chunks)."""
    if not chunk_times:
        return None
    times = np.asarray([start, *chunk_times], dtype=np.float64)
    i = int(np.argmax(np.diff(times)))
    return float(times[i + 1] - times[i]), float(times[i])


def attribute(record: StreamRecord, disruptions: list[AppliedDisruption], slack_s: float = 0.1) -> str | None:
    """The kind of the one disruption signalled during `record`'s longest gap (from `slack_s`
    before it began: tokens already sent may still arrive), or None if none or several were."""
    if record.max_gap_s is None or record.max_gap_at_s is None:
        return None
    begin, end = record.max_gap_at_s - slack_s, record.max_gap_at_s + record.max_gap_s
    hits = [d for d in disruptions if d.signalled_s is not None and begin <= d.signalled_s <= end]
    return hits[0].kind if len(hits) == 1 else None


def percentiles(values: list[float], name: str) -> dict[str, float | None]:
    """{name_p50_s, name_p99_s} of `values` (None when empty), rounded to ms/10."""
    return distribution(name, values, 4, mean=False)


def _latency(records: list[StreamRecord]) -> dict:
    ok = [r for r in records if r.status == OK]
    out: dict = {"n": len(ok)}
    for key in ("total", "ttft", "max_gap"):
        out |= percentiles([getattr(r, f"{key}_s") for r in ok if getattr(r, f"{key}_s") is not None], key)
    return out


def _added(chaos: list[StreamRecord], reference: dict[str, StreamRecord]) -> dict:
    """Chaos minus reference, per request that completed OK in both."""
    pairs = [(c, reference[c.request_id]) for c in chaos if c.status == OK and reference[c.request_id].status == OK]
    out: dict = {"n": len(pairs)}
    for key in ("total", "max_gap"):
        diffs = [getattr(c, f"{key}_s") - getattr(r, f"{key}_s") for c, r in pairs]
        out |= percentiles([d for d in diffs if d is not None], f"added_{key}")
    return out


def summarize_chaos(
    reference: list[StreamRecord], chaos: list[StreamRecord], disruptions: list[AppliedDisruption]
) -> dict:
    """Every figure of the report, from the two runs' records (same request ids) and the disruptions."""
    by_id = {r.request_id: r for r in reference}
    assert set(by_id) == {c.request_id for c in chaos}, "the two runs must hold the same requests"
    ok = [c for c in chaos if c.status == OK]
    failed = Counter(c.status or "UNFINISHED" for c in chaos if c.status != OK)
    over = [c for c in ok if c.failovers > 0]
    calm = [c for c in ok if c.failovers == 0]
    compared = [c for c in ok if by_id[c.request_id].status == OK]
    mismatched = [c.request_id for c in compared if c.tokens != by_id[c.request_id].tokens]
    applied = [d for d in disruptions if d.worker is not None]
    recovery: dict[str, dict] = {}
    for kind in sorted({d.kind for d in applied}):
        times = [d.recovery_s for d in applied if d.kind == kind and d.recovery_s is not None]
        recovery[kind] = percentiles(times, "recovery")
    ref_lat, calm_lat, over_lat = _latency(reference), _latency(calm), _latency(over)
    groups = {"reference": ref_lat, "chaos_not_failed_over": calm_lat, "chaos_failed_over": over_lat}
    added = {"not_failed_over": _added(calm, by_id), "failed_over": _added(over, by_id)}
    kinds = {c.request_id: attribute(c, applied) for c in over}
    for kind in sorted({k for k in kinds.values() if k is not None}):
        added[f"failed_over_by_{kind}"] = _added([c for c in over if kinds[c.request_id] == kind], by_id)
    return {
        "requests": len(chaos),
        "completed_ok": len(ok),
        "failed": sum(failed.values()),
        "failed_by_status": dict(sorted(failed.items())),
        "reference_failed": sum(1 for r in reference if r.status != OK),
        "failed_over_requests": len(over),
        "failovers_total": sum(c.failovers for c in chaos),
        "failed_over_fraction": round(len(over) / len(ok), 4) if ok else None,
        "failed_over_unattributed": sum(1 for k in kinds.values() if k is None),
        "compared": len(compared),
        "mismatches": len(mismatched),
        "mismatched_ids": mismatched[:20],
        "sampled_requests": sum(c.sampled for c in chaos),
        "output_tokens": sum(len(c.tokens) for c in ok),
        "disruptions": dict(sorted(Counter(d.kind for d in applied).items())),
        "disruptions_skipped": sum(1 for d in disruptions if d.worker is None),
        "recovery": recovery,
        "latency": groups,
        "added_vs_reference": added,
        "ratios": {
            "failed_over / not failed over, total p50": ratio(over_lat["total_p50_s"], calm_lat["total_p50_s"], 3),
            "failed_over / not failed over, max gap p50": ratio(
                over_lat["max_gap_p50_s"], calm_lat["max_gap_p50_s"], 3
            ),
            "chaos not failed over / reference, total p50": ratio(calm_lat["total_p50_s"], ref_lat["total_p50_s"], 3),
        },
    }


def chaos_targets(summary: dict) -> list[dict]:
    """The suite's targets, from a `summarize_chaos` summary: no stream lost, every output equal to the
    undisturbed run's, and failover exercised at all."""
    s, over = summary, summary["failed_over_requests"]
    return [
        target("streams that failed", "0", s["failed"], s["failed"] == 0),
        target(
            "outputs that differ from the undisturbed run's",
            "0",
            f"{s['mismatches']} of {s['compared']}",
            s["mismatches"] == 0 and s["compared"] > 0,
        ),
        judged("streams that failed over (the run tested failover)", ">= 1", over),
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f}"


def print_chaos_report(summary: dict, config) -> None:
    """The counts, the latency table (ms) and the ratios, on the console."""
    console = wide_console(120)
    s = summary
    console.print(
        f"chaos: {config.workers} workers, {config.n_adapters} adapters, {config.rate:g} req/s for "
        f"{config.duration_s:g} s; disruptions {s['disruptions']} (skipped {s['disruptions_skipped']})"
    )
    console.print(
        f"requests {s['requests']}: completed OK {s['completed_ok']}, failed {s['failed']} {s['failed_by_status']}, "
        f"failed over {s['failed_over_requests']} ({s['failovers_total']} failovers, "
        f"{s['failed_over_unattributed']} not attributed to one disruption); "
        f"compared with the reference {s['compared']}, mismatches {s['mismatches']}"
    )
    for title, groups, keys in (
        ("latency (ms): total, first token, largest gap between tokens", s["latency"], LATENCY_KEYS),
        ("added latency vs the same request's reference (ms)", s["added_vs_reference"], ADDED_KEYS),
    ):
        headers = ["group", "n", *(k.removeprefix("added_").removesuffix("_s").replace("_", " ") for k in keys)]
        cells = [[group, str(row["n"]), *[_ms(row[k]) for k in keys]] for group, row in groups.items()]
        console.print(rich_table(title, headers, cells, left={"group"}))
    for kind, row in s["recovery"].items():
        console.print(f"{kind}: back to serving after p50 {row['recovery_p50_s']} s, p99 {row['recovery_p99_s']} s")
    for description, value in s["ratios"].items():
        if value is not None:
            console.print(f"{description}: {value}")
