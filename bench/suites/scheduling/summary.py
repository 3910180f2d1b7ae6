"""The scheduling suite's figures from a run's outcomes: a record's fields (`summarize`), the records a run
gives (`record_groups`: per tenant in the flood) and one row per request for `requests.jsonl`."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from loraserve.bench.common.stats import quantile
from loraserve.bench.suites.scheduling.stack import FOUND, Outcome, StackRun


def _kind(reason: str) -> str:
    """A refusal's message up to its first number: the same kind of refusal counts once."""
    return re.split(r"[\d(]", reason, maxsplit=1)[0].strip()


def summarize(outcomes: list[Outcome], run: StackRun) -> dict:
    """The record's figures over `outcomes` (a subset of `run`'s, e.g. one tenant's); the adapter and
    prefetch counters are the whole run's."""
    sent = [o for o in outcomes if o.sent_s is not None]
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    queue = [o.queue_s for o in outcomes if o.queue_s is not None]
    ok = [o for o in outcomes if o.status == "ok"]
    waits = [o.adapter_load_s for o in ok if o.request.adapter]
    start = min((o.sent_s for o in sent), default=0.0)
    makespan = max((o.finished_s for o in ok), default=start) - start
    met = sum(1 for o in ok if o.ttft_s is not None and (not o.slo_s or o.ttft_s <= o.slo_s))
    w = run.workers.values()
    hits, misses = (sum(c.get(k, 0) for c in w) for k in ("prefetch_hits", "prefetch_misses"))
    found = {k: sum(c.get(f"found_{k}", 0) for c in w) for k in FOUND}
    loads = found["ready"] + found["loading"] + found["cold"]
    statuses = Counter(o.status for o in outcomes)
    return {
        "ttft_p50_s": quantile(ttft, 0.5, 5),
        "ttft_p99_s": quantile(ttft, 0.99, 5),
        "slo_attainment": round(met / len(sent), 4) if sent else None,
        "req_per_s": round(len(ok) / makespan, 3) if makespan > 0 else None,
        "prefetch_hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
        "loads_ready_before_scheduled": round(found["ready"] / loads, 4) if loads else None,
        "load_wait_s": round(sum(waits), 4),
        "load_wait_first_s": round(_first_waits(ok), 4),  # of it, the first request of each adapter
        "load_wait_mean_s": round(float(np.mean(waits)), 5) if waits else None,
        "load_wait_p99_s": quantile(waits, 0.99, 5),
        "n_requests": len(outcomes),
        "completed": len(ok),
        "refused": statuses["refused"],
        "failed": statuses["failed"],
        "unfinished": statuses["unfinished"],
        "unsent": statuses["unsent"],
        "ttft_mean_s": round(float(np.mean(ttft)), 5) if ttft else None,
        "ttft_max_s": round(max(ttft), 5) if ttft else None,
        "queue_p50_s": quantile(queue, 0.5, 5),  # the worker's Timings.queue_s: scheduler queue + worker's
        "queue_p99_s": quantile(queue, 0.99, 5),
        "failovers": sum(o.failovers for o in outcomes),
        "adapter_requests": found,  # how each adapter request found its adapter when it reached its worker
        "prefetch_hits": hits,
        "prefetch_misses": misses,
        "refusals": dict(Counter(_kind(o.reason) for o in outcomes if o.status in ("refused", "failed"))),
        "makespan_s": round(makespan, 3),
        "steps": sum(c.get("steps", 0) for c in w),
        "step_mean_s": _step_mean(run),
        "cpu_busy": run.extra.get("cpu_busy"),  # the machine's CPU busy share during the run
    }


def _first_waits(ok: list[Outcome]) -> float:
    """The adapter wait of the first request (by send time) of each adapter among `ok`: loads that nothing
    earlier in the run could have predicted."""
    first: dict[str, Outcome] = {}
    for o in sorted(ok, key=lambda o: o.sent_s or 0.0):
        if o.request.adapter:
            first.setdefault(o.request.adapter, o)
    return sum(o.adapter_load_s for o in first.values())


def _step_mean(run: StackRun) -> float | None:
    """The workers' mean step time over the run (their step-seconds histograms), None without steps."""
    n = sum(c.get("step_n", 0) for c in run.workers.values())
    return round(sum(c.get("step_s", 0.0) for c in run.workers.values()) / n, 5) if n else None


def request_rows(outcomes: list[Outcome], tags: dict) -> list[dict]:
    """One row per request (`requests.jsonl`): what the client saw and the worker's timings."""
    rows = []
    for o in outcomes:
        r = o.request
        rows.append(
            tags
            | {"request_id": r.request_id, "adapter": r.adapter, "tenant": r.tenant, "follows": r.follows}
            | {"prompt_len": r.prompt_len, "output_len": r.output_len, "status": o.status, "worker": o.worker}
            | {"sent_s": o.sent_s, "ttft_s": o.ttft_s, "finished_s": o.finished_s, "queue_s": o.queue_s}
            | {"adapter_load_s": o.adapter_load_s, "reason": o.reason}
        )
    return rows


def record_groups(scenario: str, flood: bool | None, outcomes: list[Outcome]) -> list[tuple[str | None, list[Outcome]]]:
    """The records a run gives, as (tenant, its outcomes): one for the run; for the flood, one per tenant
    and, flooded, one of every tenant (`"all"`: what the policy did for everyone, the flooder included)."""
    if scenario != "flood":
        return [(None, outcomes)]
    tenants = ("victim", "flooder") if flood else ("victim",)
    groups: list[tuple[str | None, list[Outcome]]] = [
        (t, [o for o in outcomes if o.request.tenant == t]) for t in tenants
    ]
    return [*groups, ("all", outcomes)] if flood else groups
