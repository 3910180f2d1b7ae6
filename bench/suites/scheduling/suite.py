"""`loraserve bench --suite scheduling --stack`: the default scheduling policy against `fcfs`, on the real stack.

    loraserve bench --suite scheduling --stack --quick --out /tmp/sched     # about 10 minutes on 2 shared cores
    loraserve bench --suite scheduling --stack --out results/sched
    loraserve bench --suite scheduling --stack --runner-profile runner_profile.json --quick --out /tmp/sched

Every run is a fresh `loraserve up` of real processes with `--sched-workers` emulated workers
(`stack.py`), each step waiting the time a runner profile predicts (`--runner-profile FILE`; without
it one is calibrated on this CPU's engine at the start, `bench/suites/runner_profile/suite.py`) times
`--sched-time-scale`: a device that many times slower, so the machine's cores keep room for the
workers' own step work, the services and the client. Scenarios (`bench/workloads/scheduling.py`),
each policy on the same seeded trace: `heavy-tail` at `LOAD` × the measured capacity; `flood`, tenant
`victim` at `VICTIM_LOAD` × capacity and `flooder` at 5× that, and the victim alone; `popularity`,
with a pool that holds few adapters; `conversations`. The last two also run under the default policy
with the workers' prefetch off.

Capacity is measured per scenario under fcfs: a burst of its requests, completions per second
between the 10th and the 90th percentile completion. A request's TTFT SLO is `SLO_FACTOR` × the
median TTFT of its size class unloaded (sent one at a time); it travels with the request, so the
default policy may refuse early what it predicts will miss. The flood run has a record per tenant
and one of every tenant (`tenant: "all"`). Comparisons and targets: `targets.py`. Writes
`--out/results.json`, `--out/run.json` (the profile's costs and fidelity, the settings, capacities
and SLOs), `--out/requests.jsonl` (one line per request) and the plots (`report.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loraserve.bench.common.engine_run import quiet
from loraserve.bench.common.preset import Preset
from loraserve.bench.common.results import cpu_fields, publish, write_jsonl
from loraserve.bench.suites.scheduling import report as scheduling_report
from loraserve.bench.suites.scheduling.stack import Phase, StackConfig, StackRun, StackRunner, upload_adapters
from loraserve.bench.suites.scheduling.summary import record_groups, request_rows, summarize
from loraserve.bench.suites.scheduling.targets import add_ratios, targets
from loraserve.bench.workloads import scheduling as traces
from loraserve.bench.workloads.scheduling import SchedRequest, SchedTrace
from loraserve.config_cli import setting
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.model_config import ModelConfig
from loraserve.scheduler.policy import POLICIES, PolicyConfig
from loraserve.worker.runner_profile import load_profile

log = logging.getLogger(__name__)

SCENARIOS = ("heavy-tail", "flood", "popularity", "conversations")
PREFETCH_OFF = ("popularity", "conversations")  # also run with the workers' prefetch off (default policy)
BASELINE = "fcfs"
LOAD = {"heavy-tail": 0.9, "popularity": 0.8, "conversations": 0.8}  # offered load, × capacity
VICTIM_LOAD = 0.45  # the victim's rate (= each tenant's share), × capacity; the flooder sends 5× that
FLOOD_FACTOR = 5.0
SLO_FACTOR = 5.0
WORKERS = 4
TIME_SCALE = 6.0  # the emulated device: the runner profile's, this many times slower

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


# ---- the suite ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SchedulingPreset(Preset):
    """A run's sizes: FULL or QUICK, with the flags' settings put in by `main`."""

    duration_s: dict[str, float]  # each scenario's trace
    burst: int  # requests of the capacity burst: several times the batch slots
    probe: int  # requests of each size class sent one at a time (the unloaded TTFT)
    drain_s: float
    model_dir: Path = DEMO_MODEL_DIR
    scenarios: tuple[str, ...] = SCENARIOS
    workers: int = WORKERS
    max_batch_size: int = 32
    time_scale: float = TIME_SCALE
    seed: int = 0


FULL = SchedulingPreset({"heavy-tail": 60.0, "flood": 30.0, "popularity": 60.0, "conversations": 60.0}, 800, 12, 30.0)
QUICK = SchedulingPreset({"heavy-tail": 20.0, "flood": 15.0, "popularity": 20.0, "conversations": 20.0}, 400, 6, 20.0)


def run_suite(
    settings: SchedulingPreset, profile: Path, data_dir: Path, rows: list[dict] | None = None
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
                for tenant, outcomes in record_groups(name, tags.get("flood"), run.outcomes):
                    record = {"scenario": name, "policy": policy, "role": role, "prefetch": prefetch}
                    if tenant is not None:
                        record |= {"tenant": tenant, **tags}
                    # every tenant of its run: not run.outcomes' length, which one tenant's matches when
                    # the other sent nothing
                    record["whole_run"] = tenant in (None, "all") or not tags.get("flood")
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
        "emulated step times are the runner profile's times this many times (a slower device than the "
        "profile's: room on the machine's cores for the workers' own step work and the services)",
    )
    sched_duration_scale: float = setting(1.0, "multiplies each scenario's trace duration (quick: 20/15/20/20 s)")
    runner_profile: Path | None = setting(
        None,
        "the emulated runner's profile to use (e.g. docs/runner_profile/cpu-calibrated.json, or "
        "`bench --suite runner-profile`'s runner_profile.json) instead of calibrating one at the start; "
        "results.json names it",
    )


SETTINGS = SchedulingSettings


def profile_about(path: Path, calibrated: bool, time_scale: float) -> dict:
    """What results.json says of the runner profile a run used: its path, a name (a roofline profile's
    `roofline.about.name`, else its file name without .json) and the time scale applied to it."""
    if calibrated:
        name = "calibrated on this machine's engine at the start of the run (runner-profile quick grid)"
    else:
        try:
            named = json.loads(Path(path).read_text())["roofline"]["about"]["name"]
        except (OSError, ValueError, KeyError, TypeError):
            named = None
        name = named if isinstance(named, str) and named else Path(path).stem
    return {"path": str(path), "name": name, "calibrated_here": calibrated, "time_scale": time_scale}


def main(args: argparse.Namespace) -> int:
    from loraserve.bench.common.profile_fit import GRIDS, PROFILE_FILE, write_profile

    unknown = sorted(set(args.sched_scenarios) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"--sched-scenarios: unknown {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    preset = QUICK if args.quick else FULL
    settings = preset.but(
        model_dir=args.model,
        scenarios=tuple(s for s in SCENARIOS if s in args.sched_scenarios),
        duration_s={k: v * args.sched_duration_scale for k, v in preset.duration_s.items()},
        workers=args.sched_workers,
        max_batch_size=args.max_batch_size,
        time_scale=args.sched_time_scale,
        seed=args.seed,
    )
    out = args.out or Path(tempfile.mkdtemp(prefix="loraserve-sched-out-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model = ModelConfig.from_dir(args.model)
    if args.runner_profile:
        measured = load_profile(args.runner_profile, model)
    else:
        quiet(None)
        measured = write_profile(args.model, GRIDS["quick"], out / PROFILE_FILE, args.seed)
    profile_path = out / "runner_profile_scaled.json"
    measured.scaled(settings.time_scale).write(profile_path)
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
    scheduling_report.print_report(records)
    about = profile_about(args.runner_profile or out / PROFILE_FILE, not args.runner_profile, settings.time_scale)
    fields = {k: run[k] for k in ("policies", "targets", "scenarios", "wall_s")}
    publish(out, "scheduling", records, machine_extra=cpu_fields(), runner_profile=about, **fields)
    (out / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    write_jsonl(out / "requests.jsonl", rows)
    for path in scheduling_report.plot(records, out):
        log.info("wrote %s", path)
    return 0
