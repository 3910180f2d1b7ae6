"""`loraserve bench --suite scheduling`: the default scheduling policy against `fcfs` on the same traces.

    loraserve bench --suite scheduling --quick --out /tmp/sched     # 1-4 minutes on 2 shared cores
    loraserve bench --suite scheduling --out results/sched

The stack is SIMULATED (`bench/scheduling_sim.py`): the real `SchedulerPolicy` and the real worker
step scheduler and page bookkeeping, `--sched-workers` workers, with every step and adapter load
charged the time a cost model predicts — a model fitted at start-up to steps of the real engine
timed on this machine (`bench/scheduling_costs.py`). Each policy replays the same seeded traces
(`bench/scheduling_traces.py`):

- `heavy-tail`: 90 % short and 10 % long requests (heavy-tailed outputs), Zipf adapters of ranks
  8–64, Poisson at `LOAD` × the measured capacity;
- `flood`: tenant `victim` at `VICTIM_LOAD` × capacity (its share), tenant `flooder` at 5× that; and
  the victim alone (the calm run);
- `popularity`: Zipf over many adapters, with a pool that holds only a few of them besides the KV.

Capacity is measured per scenario: a burst of its requests under `fcfs`, completions per second
between the 10th and the 90th percentile completion. A request's TTFT SLO is `SLO_FACTOR` × the
median TTFT of its size class at light load (`LIGHT_LOAD` × capacity, `fcfs`). Refused and failed
requests miss the SLO. Writes `--out/results.json` (a list of records: scenario, policy, TTFT p50 /
p99, SLO attainment, req/s, prefetch hit rate, ...), `--out/run.json` (the cost model, the machine,
the settings, the targets) and the plots (`bench/scheduling_report.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np

from loraserve.bench import scheduling_report
from loraserve.bench import scheduling_traces as traces
from loraserve.bench.scheduling_costs import QUICK_GRID, CostModel, measure_costs
from loraserve.bench.scheduling_sim import Outcome, SimConfig, SimResult, Simulation
from loraserve.bench.scheduling_traces import SimRequest, SimTrace
from loraserve.model_config import ModelConfig
from loraserve.scheduler.policy import POLICIES, PolicyConfig, SchedulerPolicy

log = logging.getLogger(__name__)

SCENARIOS = ("heavy-tail", "flood", "popularity")
BASELINE = "fcfs"
LOAD = {"heavy-tail": 0.9, "popularity": 0.8}  # offered load, × capacity
VICTIM_LOAD = 0.45  # the victim's rate (= each tenant's share), × capacity; the flooder sends 5× that
FLOOD_FACTOR = 5.0
LIGHT_LOAD = 0.1  # where the SLO's "unloaded" TTFT is measured
SLO_FACTOR = 5.0
BURST = 600  # requests in the capacity burst (under the queue's 1024)

FULL = {"duration_s": {"heavy-tail": 180.0, "flood": 90.0, "popularity": 180.0}, "repeats": 3}
QUICK = {"duration_s": {"heavy-tail": 60.0, "flood": 30.0, "popularity": 60.0}, "repeats": 2}
POOL_PAGES = {"heavy-tail": 1536, "flood": 1536, "popularity": 512}
ADAPTERS = {"heavy-tail": 64, "popularity": 1000}


def policies() -> tuple[str, str]:
    """(the default policy, the baseline): PolicyConfig's default against fcfs."""
    return PolicyConfig().policy, BASELINE


def make_policy(name: str) -> SchedulerPolicy:
    return SchedulerPolicy(PolicyConfig(policy=name))


# ---- the pieces --------------------------------------------------------------------------------------
def scenario_trace(name: str, rate: float, duration_s: float, seed: int) -> SimTrace:
    """`name`'s trace at total `rate` (flood: `rate` is the victim's; the flooder sends 5×)."""
    if name == "heavy-tail":
        return traces.heavy_tail(rate, duration_s, seed, n_adapters=ADAPTERS["heavy-tail"])
    if name == "flood":
        return traces.flood(rate, FLOOD_FACTOR * rate, duration_s, seed)
    return traces.popularity(rate, duration_s, seed, n_adapters=ADAPTERS["popularity"])


def simulate(trace: SimTrace, policy: str, config: SimConfig, costs: CostModel, model: ModelConfig, slo) -> SimResult:
    return Simulation(trace, make_policy(policy), config, costs, model, slo).run()


def capacity(name: str, config: SimConfig, costs: CostModel, model: ModelConfig, seed: int, n: int = BURST) -> float:
    """Completions per second of a saturating burst of `n` requests under fcfs, between its 10 % and
    90 % completions."""
    long = scenario_trace(name, 100.0, n / 50.0, seed + 1000)  # plenty of requests of the scenario's mix
    burst = traces.burst(long, n)
    result = simulate(burst, BASELINE, config, costs, model, lambda r: 1.0)
    done = np.sort([o.finished_s for o in result.outcomes if o.status == "ok"])
    lo, hi = int(0.1 * len(done)), int(0.9 * len(done))
    return (hi - lo) / (done[hi] - done[lo])


def class_slos(trace: SimTrace, config: SimConfig, costs: CostModel, model: ModelConfig) -> dict[str, float]:
    """SLO_FACTOR × the median TTFT of each size class, from `trace` (light load) under fcfs."""
    result = simulate(trace, BASELINE, config, costs, model, lambda r: 1.0)
    by_class: dict[str, list[float]] = {}
    for o in result.outcomes:
        if o.ttft_s is not None:
            by_class.setdefault(o.request.size, []).append(o.ttft_s)
    return {size: SLO_FACTOR * float(np.median(v)) for size, v in by_class.items()}


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.quantile(values, q)), 5) if values else None


def _kind(reason: str) -> str:
    """A refusal's message up to its first number: the same kind of refusal counts once."""
    return re.split(r"[\d(]", reason, maxsplit=1)[0].strip()


def summarize(outcomes: list[Outcome], result: SimResult, start_s: float) -> dict:
    """The record's figures over `outcomes` (a subset of `result`'s, e.g. one tenant's)."""
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    queued = [o.queued_s for o in outcomes if o.queued_s is not None]
    ok = [o for o in outcomes if o.status == "ok"]
    finished = [o.finished_s for o in result.outcomes if o.finished_s is not None]
    makespan = (max(finished) - start_s) if finished else 0.0
    met = sum(1 for o in outcomes if o.status == "ok" and o.ttft_s is not None and o.ttft_s <= o.slo_s)
    w = result.workers.values()
    hits, late, misses = (sum(c[k] for c in w) for k in ("prefetch_hits", "prefetch_late", "misses"))
    needed = hits + late + misses
    statuses = [o.status for o in outcomes]
    return {
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "slo_attainment": round(met / len(outcomes), 4) if outcomes else None,
        "req_per_s": round(len(ok) / makespan, 3) if makespan > 0 else None,
        "prefetch_hit_rate": round(hits / needed, 4) if needed else 0.0,
        "n_requests": len(outcomes),
        "completed": len(ok),
        "refused": statuses.count("refused"),
        "failed": statuses.count("failed"),
        "unfinished": statuses.count("unfinished"),
        "ttft_mean_s": round(float(np.mean(ttft)), 5) if ttft else None,
        "ttft_max_s": round(max(ttft), 5) if ttft else None,
        "queued_p50_s": percentile(queued, 0.5),  # arrival to the worker: what the policy decides
        "queued_p99_s": percentile(queued, 0.99),
        "migrations": sum(o.migrations for o in outcomes),
        "adapter_loads_needed": needed,
        "prefetch_hits": hits,
        "prefetch_late": late,
        "prefetch_hints_sent": result.decisions.get("PrefetchOn", 0),
        "refusals": dict(Counter(_kind(o.reason) for o in outcomes if o.status in ("refused", "failed"))),
        "preemptions": sum(c["preemptions"] for c in w),
        "adapter_evictions": sum(c["evictions"] for c in w),
        "makespan_s": round(makespan, 3),
    }


# ---- the suite ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SuiteSettings:
    scenarios: tuple[str, ...] = SCENARIOS
    duration_s: dict = dataclasses.field(default_factory=lambda: dict(QUICK["duration_s"]))
    workers: int = 2
    max_batch_size: int = 32
    seed: int = 0
    burst: int = BURST


def sim_config(name: str, settings: SuiteSettings) -> SimConfig:
    return SimConfig(workers=settings.workers, max_batch_size=settings.max_batch_size, pool_pages=POOL_PAGES[name])


def run_suite(settings: SuiteSettings, costs: CostModel, model: ModelConfig) -> tuple[list[dict], dict]:
    """Every scenario under both policies; returns (records, per-scenario settings)."""
    default, baseline = policies()
    records, scenarios = [], {}
    for name in settings.scenarios:
        config = sim_config(name, settings)
        cap = capacity(name, config, costs, model, settings.seed, settings.burst)
        duration = settings.duration_s[name]
        share = VICTIM_LOAD if name == "flood" else LOAD[name]
        trace = scenario_trace(name, share * cap, duration, settings.seed)
        light = scenario_trace(name, LIGHT_LOAD * cap, duration, settings.seed + 2000)
        slos = class_slos(light.only("victim") if name == "flood" else light, config, costs, model)

        def slo_of(r: SimRequest, slos=slos) -> float:
            return slos.get(r.size, max(slos.values()))

        runs = [(trace, {})]
        if name == "flood":
            runs = [(trace, {"flood": True}), (trace.only("victim"), {"flood": False})]
        scenarios[name] = {
            "capacity_req_per_s": round(cap, 2),
            "offered_req_per_s": round(len(trace.requests) / duration, 2),
            "slo_s": {k: round(v, 5) for k, v in slos.items()},
            "sim": dataclasses.asdict(config),
            "trace": trace.params,
        }
        for policy, role in ((default, "default"), (baseline, "baseline")):
            for run_trace, tags in runs:
                started = time.perf_counter()
                result = simulate(run_trace, policy, config, costs, model, slo_of)
                wall = round(time.perf_counter() - started, 2)
                groups = [(None, result.outcomes)]
                if name == "flood":
                    tenants = ("victim", "flooder") if tags["flood"] else ("victim",)
                    groups = [(t, [o for o in result.outcomes if o.request.tenant == t]) for t in tenants]
                for tenant, outcomes in groups:
                    record = {"scenario": name, "policy": policy, "role": role}
                    if tenant is not None:
                        record |= {"tenant": tenant, **tags}
                    start = run_trace.requests[0].arrival_s if run_trace.requests else 0.0
                    record |= summarize(outcomes, result, start)
                    record |= {
                        "capacity_req_per_s": round(cap, 2),
                        "offered_req_per_s": round(len(outcomes) / duration, 2),
                        "seed": settings.seed,
                        "sim_wall_s": wall,
                    }
                    records.append(record)
                log.info("%s %s %s: %.1f s of wall time, %d events", name, policy, tags or "", wall, result.events)
    add_ratios(records)
    return records, scenarios


def _key(record: dict) -> tuple:
    return (record["scenario"], record.get("tenant"), record.get("flood"))


def add_ratios(records: list[dict]) -> None:
    """On each default-policy record: fcfs p99 / its p99 (improvement) and its req/s / fcfs's."""
    baseline = {_key(r): r for r in records if r["role"] == "baseline"}
    for r in records:
        b = baseline.get(_key(r))
        if r["role"] != "default" or b is None:
            continue
        if r["ttft_p99_s"] and b["ttft_p99_s"]:
            r["ttft_p99_improvement_vs_fcfs"] = round(b["ttft_p99_s"] / r["ttft_p99_s"], 3)
        if r["req_per_s"] and b["req_per_s"]:
            r["req_per_s_vs_fcfs"] = round(r["req_per_s"] / b["req_per_s"], 4)


def targets(records: list[dict]) -> list[dict]:
    """The scheduling targets, each {name, goal, value, met}, for the scenarios the records cover."""

    def find(scenario: str, **tags) -> dict | None:
        def matches(r: dict) -> bool:
            return r["scenario"] == scenario and r["role"] == "default" and all(r.get(k) == v for k, v in tags.items())

        return next((r for r in records if matches(r)), None)

    def target(name: str, goal: str, value: float | None, met: bool) -> dict:
        return {"name": name, "goal": goal, "value": value, "met": bool(value is not None and met)}

    out = []
    if (ht := find("heavy-tail")) is not None:
        value = ht.get("ttft_p99_improvement_vs_fcfs")
        out.append(target("heavy-tail p99 TTFT, fcfs / default", ">= 3", value, value is not None and value >= 3))
    flooded, calm = find("flood", tenant="victim", flood=True), find("flood", tenant="victim", flood=False)
    if flooded and calm and flooded["ttft_p99_s"] and calm["ttft_p99_s"]:
        value = round(flooded["ttft_p99_s"] / calm["ttft_p99_s"], 3)
        out.append(target("victim p99 TTFT, flood / calm (default policy)", "<= 1.5", value, value <= 1.5))
    if (pop := find("popularity")) is not None:
        value = pop["prefetch_hit_rate"]
        out.append(target("popularity prefetch hit rate (default policy)", ">= 0.5", value, value >= 0.5))
    for r in records:
        if r["role"] == "default" and "req_per_s_vs_fcfs" in r and r.get("tenant") in (None, "victim"):
            tag = f" ({r['tenant']}, flood={r['flood']})" if "tenant" in r else ""
            value = r["req_per_s_vs_fcfs"]
            out.append(target(f"{r['scenario']}{tag} req/s, default / fcfs", ">= 0.99", value, value >= 0.99))
    return out


# ---- the command -------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The scheduling suite's own flags (it also reads --quick, --out, --seed, --model, --threads, --max-batch-size)."""
    p = parser.add_argument_group("scheduling suite (--suite scheduling)")
    p.add_argument(
        "--sched-scenarios", nargs="+", default=list(SCENARIOS), metavar="SCENARIO", help=" ".join(SCENARIOS)
    )
    p.add_argument("--sched-workers", type=int, default=2, help="simulated workers")
    p.add_argument(
        "--sched-duration-scale",
        type=float,
        default=1.0,
        help="multiplies each scenario's trace duration (quick: 60/30/60 s)",
    )
    p.add_argument(
        "--sched-costs",
        type=Path,
        help="a run.json (or a runner_profile.json) whose cost model to reuse instead of measuring",
    )


def main(args: argparse.Namespace) -> int:
    import torch

    unknown = sorted(set(args.sched_scenarios) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"--sched-scenarios: unknown {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    torch.set_num_threads(args.threads)  # one worker process per core: each step runs on one thread
    preset = QUICK if args.quick else FULL
    settings = SuiteSettings(
        scenarios=tuple(s for s in SCENARIOS if s in args.sched_scenarios),
        duration_s={k: v * args.sched_duration_scale for k, v in preset["duration_s"].items()},
        workers=args.sched_workers,
        max_batch_size=args.max_batch_size,
        seed=args.seed,
        burst=BURST,
    )
    started = time.perf_counter()
    if args.sched_costs:
        costs = cost_model_from(json.loads(args.sched_costs.read_text())["costs"])
    else:
        logging.getLogger("loraserve.worker").setLevel(max(logging.WARNING, logging.getLogger().level))
        costs = measure_costs(args.model, dataclasses.replace(QUICK_GRID, repeats=preset["repeats"]), args.seed)
    log.info("cost model: %s", costs.as_dict())
    records, scenarios = run_suite(settings, costs, ModelConfig.from_dir(args.model))
    run = {
        "simulated": "the stack is simulated: the real scheduler policy and worker step scheduler, "
        "with step and adapter-load times from a cost model measured on the real engine on this machine",
        "policies": dict(zip(("default", "baseline"), policies(), strict=True)),
        "available_policies": list(POLICIES),
        "costs": costs.as_dict(),
        "settings": {**dataclasses.asdict(settings), "quick": bool(args.quick)},
        "scenarios": scenarios,
        "targets": targets(records),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    scheduling_report.print_report(records, run)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(records, indent=1) + "\n")
        (args.out / "run.json").write_text(json.dumps(run, indent=1) + "\n")
        for path in scheduling_report.plot(records, args.out):
            log.info("wrote %s", path)
        print(f"results: {args.out / 'results.json'}")
    return 0


def cost_model_from(d: dict) -> CostModel:
    """The inverse of `CostModel.as_dict` (a run.json's or a runner profile's "costs")."""
    return CostModel.from_dict(d)
