"""`loraserve bench --suite scheduling --stack`: the default scheduling policy against `fcfs`, on the real stack.

    loraserve bench --suite scheduling --stack --quick --out /tmp/sched     # about 10 minutes on 2 shared cores
    loraserve bench --suite scheduling --stack --out results/sched
    loraserve bench --suite scheduling --stack --runner-profile runner_profile.json --quick --out /tmp/sched

Every run is a fresh `loraserve up` of real processes (`bench/suites/scheduling/stack.py`): the adapter
store, the scheduler under the policy, `--sched-workers` workers with the emulated runner, the
gateway, and this process as the client. The emulated runner (`--runner emulated`) is the real
worker, engine, pool and adapter loading with each step's forward pass replaced by a wait of the
time a profile measured on the real engine predicts (`bench/suites/runner_profile/suite.py`: calibrated at the
start of the run unless `--runner-profile` is given), multiplied by `--sched-time-scale`: a device
that many times slower than this CPU's engine, so that the two cores keep room for the services at
the loads where scheduling matters (the workers' own step work still runs at full cost).

Scenarios (`bench/workloads/scheduling.py`), each policy on the same seeded trace:

- `heavy-tail`: 90 % short and 10 % long requests (heavy-tailed outputs), Zipf adapters of ranks
  8–64, Poisson at `LOAD` × the measured capacity;
- `flood`: tenant `victim` at `VICTIM_LOAD` × capacity (its share), tenant `flooder` at 5× that; and
  the victim alone (the calm run);
- `popularity`: Zipf over many adapters, with a pool that holds only a few of them besides the KV;
- `conversations`: multi-turn chats whose follow-up turns reuse their adapter after a think time.

`popularity` and `conversations` also run under the default policy with the workers' prefetch off
(`--no-prefetch`): what prefetching saves in time spent waiting for adapters.

Capacity is measured per scenario on a stack under fcfs: a burst of its requests, completions per
second between the 10th and the 90th percentile completion. A request's TTFT SLO is `SLO_FACTOR` ×
the median TTFT of its size class unloaded (requests of the scenario sent one at a time on that
stack); it travels with the request (`ttft_slo_s`), so the default policy may refuse early what it
predicts will miss. Refused and failed requests miss the SLO. Writes `--out/results.json` (the
records), `--out/run.json` (the profile used, the machine, the settings, capacities and SLOs, the
targets), `--out/requests.jsonl` (one line per request of every run) and the plots
(`bench/suites/scheduling/report.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loraserve.bench.common.results import cpu_fields, write_results
from loraserve.bench.common.settings import add_settings
from loraserve.bench.common.stats import quantile
from loraserve.bench.suites.scheduling import report as scheduling_report
from loraserve.bench.suites.scheduling.stack import (
    FOUND,
    Outcome,
    Phase,
    StackConfig,
    StackRun,
    StackRunner,
    upload_adapters,
)
from loraserve.bench.workloads import scheduling as traces
from loraserve.bench.workloads.scheduling import SchedRequest, SchedTrace
from loraserve.config_cli import setting
from loraserve.model_config import ModelConfig
from loraserve.scheduler.policy import POLICIES, PolicyConfig
from loraserve.worker.runner_profile import RunnerProfile, load_profile

log = logging.getLogger(__name__)

SCENARIOS = ("heavy-tail", "flood", "popularity", "conversations")
PREFETCH_OFF = ("popularity", "conversations")  # also run with the workers' prefetch off (default policy)
BASELINE = "fcfs"
LOAD = {"heavy-tail": 0.9, "popularity": 0.8, "conversations": 0.8}  # offered load, × capacity
VICTIM_LOAD = 0.45  # the victim's rate (= each tenant's share), × capacity; the flooder sends 5× that
FLOOD_FACTOR = 5.0
SLO_FACTOR = 5.0
WORKERS = 4
TIME_SCALE = 6.0  # the emulated device: this CPU's engine, this many times slower

FULL = {"duration_s": {"heavy-tail": 60.0, "flood": 30.0, "popularity": 60.0, "conversations": 60.0}}
FULL |= {"burst": 800, "probe": 12, "drain_s": 30.0}  # bursts: several times the batch slots
QUICK = {"duration_s": {"heavy-tail": 20.0, "flood": 15.0, "popularity": 20.0, "conversations": 20.0}}
QUICK |= {"burst": 400, "probe": 6, "drain_s": 20.0}
POOL_PAGES = {"heavy-tail": 1536, "flood": 1536, "popularity": 512, "conversations": 512}
ADAPTERS = {"heavy-tail": 64, "popularity": 1000, "conversations": 1000}


def policies() -> tuple[str, str]:
    """(the default policy, the baseline): PolicyConfig's default against fcfs."""
    return PolicyConfig().policy, BASELINE


# ---- the pieces --------------------------------------------------------------------------------------
def scenario_trace(name: str, rate: float, duration_s: float, seed: int) -> SchedTrace:
    """`name`'s trace at total `rate` (flood: `rate` is the victim's; the flooder sends 5×)."""
    if name == "heavy-tail":
        return traces.heavy_tail(rate, duration_s, seed, n_adapters=ADAPTERS["heavy-tail"])
    if name == "flood":
        return traces.flood(rate, FLOOD_FACTOR * rate, duration_s, seed)
    if name == "conversations":
        return traces.conversations(rate, duration_s, seed, n_adapters=ADAPTERS["conversations"])
    return traces.popularity(rate, duration_s, seed, n_adapters=ADAPTERS["popularity"])


def every_adapter(seed: int, scenarios: tuple[str, ...] = SCENARIOS) -> dict[str, int]:
    """Every adapter the scenarios ask for (name -> rank): uploaded once, shared by the stacks."""
    out: dict[str, int] = {}
    for name in scenarios:
        out |= scenario_trace(name, 1.0, 1.0, seed).adapters
    return out


def capacity_of(run: StackRun) -> float:
    """Completions per second of a saturating burst, between its 10 % and 90 % completions."""
    done = np.sort([o.finished_s for o in run.outcomes if o.status == "ok"])
    if len(done) < 10:
        raise RuntimeError(f"the capacity burst completed only {len(done)} requests")
    lo, hi = int(0.1 * len(done)), int(0.9 * len(done))
    return (hi - lo) / max(done[hi] - done[lo], 1e-6)


def class_slos(run: StackRun) -> dict[str, float]:
    """SLO_FACTOR × the median unloaded TTFT of each size class."""
    by_class: dict[str, list[float]] = {}
    for o in run.outcomes:
        if o.ttft_s is not None:
            by_class.setdefault(o.request.size, []).append(o.ttft_s)
    if not by_class:
        raise RuntimeError("no unloaded request got a first token")
    return {size: SLO_FACTOR * float(np.median(v)) for size, v in by_class.items()}


def probe_trace(trace: SchedTrace, n: int) -> SchedTrace:
    """Up to `n` requests of each size class of `trace` (sent one at a time: the unloaded TTFT)."""
    picked: list[SchedRequest] = []
    for size in dict.fromkeys(r.size for r in trace.requests):
        picked += [r for r in trace.requests if r.size == size][:n]
    alone = tuple(dataclasses.replace(r, follows=None) for r in picked)
    return dataclasses.replace(traces.burst(trace, 0), requests=alone)


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile of `values` as the scheduling records give it (5 digits), None when empty."""
    return quantile(values, q, 5)


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
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "slo_attainment": round(met / len(sent), 4) if sent else None,
        "req_per_s": round(len(ok) / makespan, 3) if makespan > 0 else None,
        "prefetch_hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
        "loads_ready_before_scheduled": round(found["ready"] / loads, 4) if loads else None,
        "load_wait_s": round(sum(waits), 4),
        "load_wait_mean_s": round(float(np.mean(waits)), 5) if waits else None,
        "load_wait_p99_s": percentile(waits, 0.99),
        "n_requests": len(outcomes),
        "completed": len(ok),
        "refused": statuses["refused"],
        "failed": statuses["failed"],
        "unfinished": statuses["unfinished"],
        "unsent": statuses["unsent"],
        "ttft_mean_s": round(float(np.mean(ttft)), 5) if ttft else None,
        "ttft_max_s": round(max(ttft), 5) if ttft else None,
        "queue_p50_s": percentile(queue, 0.5),  # the worker's Timings.queue_s: scheduler queue + worker's
        "queue_p99_s": percentile(queue, 0.99),
        "failovers": sum(o.failovers for o in outcomes),
        "adapter_requests": found,  # how each adapter request found its adapter when it reached its worker
        "prefetch_hits": hits,
        "prefetch_misses": misses,
        "refusals": dict(Counter(_kind(o.reason) for o in outcomes if o.status in ("refused", "failed"))),
        "makespan_s": round(makespan, 3),
        "steps": sum(c.get("steps", 0) for c in w),
    }


# ---- the suite ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SuiteSettings:
    model_dir: Path
    scenarios: tuple[str, ...] = SCENARIOS
    duration_s: dict = dataclasses.field(default_factory=lambda: dict(QUICK["duration_s"]))
    workers: int = WORKERS
    max_batch_size: int = 32
    time_scale: float = TIME_SCALE
    seed: int = 0
    burst: int = QUICK["burst"]
    probe: int = QUICK["probe"]
    drain_s: float = QUICK["drain_s"]


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


def run_suite(
    settings: SuiteSettings, profile: Path, data_dir: Path, rows: list[dict] | None = None
) -> tuple[list[dict], dict]:
    """Every scenario under both policies on the real stack; returns (records, per-scenario settings).
    Appends one row per request to `rows` when given."""
    default, baseline = policies()
    vocab = ModelConfig.from_dir(settings.model_dir).vocab_size
    records, scenarios = [], {}

    def runner(name: str, policy: str, prefetch: bool = True) -> StackRunner:
        config = StackConfig(
            settings.model_dir,
            profile,
            data_dir,
            workers=settings.workers,
            max_batch_size=settings.max_batch_size,
            pool_pages=POOL_PAGES[name],
            policy=policy,
            prefetch=prefetch,
            drain_s=settings.drain_s,
        )
        return StackRunner(config, vocab, settings.seed)

    for name in settings.scenarios:
        duration = settings.duration_s[name]
        sample = scenario_trace(name, 100.0, max(10.0, settings.burst / 50.0), settings.seed + 1000)
        probe, burst = probe_trace(sample, settings.probe), traces.burst(sample, settings.burst)
        if name == "flood":  # the victim's unloaded latency; the burst of both tenants' mix
            probe = probe_trace(sample.only("victim"), settings.probe)
        unloaded, saturated = runner(name, baseline).run([Phase(probe, sequential=True), Phase(burst)])
        cap, slos = capacity_of(saturated), class_slos(unloaded)
        log.info("%s: capacity %.1f req/s, SLOs %s", name, cap, {k: round(v, 4) for k, v in slos.items()})
        share = VICTIM_LOAD if name == "flood" else LOAD[name]
        trace = scenario_trace(name, share * cap, duration, settings.seed)

        def slo_of(r: SchedRequest, slos=slos) -> float:
            return slos.get(r.size, max(slos.values()))

        runs = [(trace, {})]
        if name == "flood":
            runs = [(trace, {"flood": True}), (trace.only("victim"), {"flood": False})]
        scenarios[name] = {
            "capacity_req_per_s": round(cap, 2),
            "offered_req_per_s": round(len(trace.requests) / duration, 2),
            "slo_s": {k: round(v, 5) for k, v in slos.items()},
            "pool_pages": POOL_PAGES[name],
            "trace": trace.params,
        }
        plan = [(default, "default", True), (baseline, "baseline", True)]
        if name in PREFETCH_OFF:
            plan.append((default, "default", False))
        for policy, role, prefetch in plan:
            for run_trace, tags in runs:
                (run,) = runner(name, policy, prefetch).run([Phase(run_trace, slo_of)])
                if rows is not None:
                    what = {"scenario": name, "policy": policy, "prefetch": prefetch} | tags
                    rows += request_rows(run.outcomes, what)
                groups = [(None, run.outcomes)]
                if name == "flood":
                    tenants = ("victim", "flooder") if tags["flood"] else ("victim",)
                    groups = [(t, [o for o in run.outcomes if o.request.tenant == t]) for t in tenants]
                for tenant, outcomes in groups:
                    record = {"scenario": name, "policy": policy, "role": role, "prefetch": prefetch}
                    if tenant is not None:
                        record |= {"tenant": tenant, **tags}
                    record |= summarize(outcomes, run)
                    record |= {
                        "stack": True,
                        "n_workers": settings.workers,
                        "time_scale": settings.time_scale,
                        "capacity_req_per_s": round(cap, 2),
                        "offered_req_per_s": round(len(outcomes) / duration, 2),
                        "seed": settings.seed,
                        "wall_s": run.wall_s,
                        "stack_start_s": run.started_s,
                    }
                    records.append(record)
                log.info("%s %s prefetch=%s %s: %.1f s", name, policy, prefetch, tags or "", run.wall_s)
    add_ratios(records)
    return records, scenarios


def _key(record: dict) -> tuple:
    return (record["scenario"], record.get("tenant"), record.get("flood"))


def add_ratios(records: list[dict]) -> None:
    """On each default-policy record with prefetch on: fcfs p99 / its p99 (improvement), its p50 and p99
    over fcfs's, its req/s over fcfs's; and on one with prefetch off, its load wait over prefetch on's."""
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
        if r["ttft_p99_s"] and b["ttft_p99_s"]:
            r["ttft_p99_improvement_vs_fcfs"] = round(b["ttft_p99_s"] / r["ttft_p99_s"], 3)
            r["ttft_p99_vs_fcfs"] = round(r["ttft_p99_s"] / b["ttft_p99_s"], 4)
        if r["ttft_p50_s"] and b["ttft_p50_s"]:
            r["ttft_p50_vs_fcfs"] = round(r["ttft_p50_s"] / b["ttft_p50_s"], 4)
        if r["req_per_s"] and b["req_per_s"]:
            r["req_per_s_vs_fcfs"] = round(r["req_per_s"] / b["req_per_s"], 4)


def targets(records: list[dict]) -> list[dict]:
    """The scheduling targets, each {name, goal, value, met}, for the scenarios the records cover."""

    def find(scenario: str, prefetch: bool = True, **tags) -> dict | None:
        def matches(r: dict) -> bool:
            return (
                r["scenario"] == scenario
                and r["role"] == "default"
                and r["prefetch"] == prefetch
                and all(r.get(k) == v for k, v in tags.items())
            )

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
    for scenario in ("conversations", "popularity"):
        off = find(scenario, prefetch=False)
        if off is not None and "load_wait_vs_prefetch" in off:
            value = off["load_wait_vs_prefetch"]
            out.append(target(f"{scenario} load wait, prefetch off / on", ">= 5", value, value >= 5))
    if (conv := find("conversations")) is not None:
        value = conv["prefetch_hit_rate"]
        out.append(target("conversations prefetch hit rate (default policy)", ">= 0.5", value, value >= 0.5))
    for r in records:
        if r["role"] != "default" or not r["prefetch"] or r.get("tenant") == "flooder":
            continue
        tag = f" ({r['tenant']}, flood={r['flood']})" if "tenant" in r else ""
        for key, what, goal, ok in (
            ("ttft_p50_vs_fcfs", "TTFT p50", "<= 1.05", lambda v: v <= 1.05),
            ("ttft_p99_vs_fcfs", "TTFT p99", "<= 1.05", lambda v: v <= 1.05),
            ("req_per_s_vs_fcfs", "req/s", ">= 0.95", lambda v: v >= 0.95),
        ):
            if key in r:
                out.append(target(f"{r['scenario']}{tag} {what}, default / fcfs", goal, r[key], ok(r[key])))
    return out


# ---- the command -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SchedulingSettings:
    """The scheduling suite's own flags (it also reads --quick, --out, --seed, --model, --max-batch-size)."""

    stack: bool = setting(
        False,
        "run the scenarios through the real stack (emulated workers): the suite's only mode, named "
        "for clarity (the simulation it replaced is gone)",
    )
    sched_scenarios: tuple[str, ...] = setting(SCENARIOS, " ".join(SCENARIOS), nargs="+", metavar="SCENARIO")
    sched_workers: int = setting(WORKERS, "emulated worker processes per stack")
    sched_time_scale: float = setting(
        TIME_SCALE,
        "emulated step times are the profile's times this many times (a slower device: room for the services)",
    )
    sched_duration_scale: float = setting(1.0, "multiplies each scenario's trace duration (quick: 20/15/20/20 s)")
    runner_profile: Path | None = setting(
        None,
        "the emulated runner's profile to use (`bench --suite runner-profile`'s runner_profile.json) "
        "instead of calibrating one at the start",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The scheduling suite's flags (`SchedulingSettings`), in a group of their own."""
    add_settings(parser.add_argument_group("scheduling suite (--suite scheduling)"), SchedulingSettings)


def scaled_profile(profile: RunnerProfile, scale: float) -> RunnerProfile:
    """`profile` with every step taking `scale` times as long (its runner part and its whole-step costs)."""
    costs = dataclasses.replace(profile.costs, step_coef=tuple(c * scale for c in profile.costs.step_coef))
    fidelity = {**profile.fidelity, "time_scale": scale}
    runner = tuple(c * scale for c in profile.runner_coef)
    return dataclasses.replace(profile, runner_coef=runner, costs=costs, fidelity=fidelity)


def main(args: argparse.Namespace) -> int:
    from loraserve.bench.suites.runner_profile.suite import GRIDS, PROFILE_FILE, write_profile

    unknown = sorted(set(args.sched_scenarios) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"--sched-scenarios: unknown {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    preset = QUICK if args.quick else FULL
    settings = SuiteSettings(
        model_dir=args.model,
        scenarios=tuple(s for s in SCENARIOS if s in args.sched_scenarios),
        duration_s={k: v * args.sched_duration_scale for k, v in preset["duration_s"].items()},
        workers=args.sched_workers,
        max_batch_size=args.max_batch_size,
        time_scale=args.sched_time_scale,
        seed=args.seed,
        burst=preset["burst"],
        probe=preset["probe"],
        drain_s=preset["drain_s"],
    )
    out = args.out or Path(tempfile.mkdtemp(prefix="loraserve-sched-out-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = ModelConfig.from_dir(args.model)
    if args.runner_profile:
        measured = load_profile(args.runner_profile, model)
    else:
        logging.getLogger("loraserve.worker").setLevel(max(logging.WARNING, logging.getLogger().level))
        measured = write_profile(args.model, GRIDS["quick"], out / PROFILE_FILE, args.seed)
    profile_path = out / "runner_profile_scaled.json"
    scaled_profile(measured, settings.time_scale).write(profile_path)
    scratch = Path(tempfile.mkdtemp(prefix="loraserve-sched-store-"))
    try:
        data_dir = scratch / "data"
        adapters = every_adapter(args.seed, settings.scenarios)
        upload_s = upload_adapters(args.model, data_dir, adapters, profile_path, args.seed)
        log.info("uploaded %d adapters in %.1f s", len(adapters), upload_s)
        rows: list[dict] = []
        records, scenarios = run_suite(settings, profile_path, data_dir, rows)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    run = {
        "stack": "the real stack: adapter store, scheduler, gateway and emulated worker processes, this "
        "process the client; emulated steps wait the profile's predicted times × time_scale",
        "policies": dict(zip(("default", "baseline"), policies(), strict=True)),
        "available_policies": list(POLICIES),
        "profile": {"source": str(args.runner_profile or out / PROFILE_FILE), "time_scale": settings.time_scale}
        | {"fidelity": measured.fidelity, "costs": measured.costs.as_dict()},
        "machine": cpu_fields(),
        "settings": {**dataclasses.asdict(settings), "model_dir": str(settings.model_dir), "quick": bool(args.quick)},
        "scenarios": scenarios,
        "adapters_uploaded": len(adapters),
        "upload_s": round(upload_s, 1),
        "targets": targets(records),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    scheduling_report.print_report(records, run)
    write_results(out, "scheduling", records, machine_extra=cpu_fields())
    (out / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    (out / "requests.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for path in scheduling_report.plot(records, out):
        log.info("wrote %s", path)
    print(f"results: {out / 'results.json'}")
    return 0
