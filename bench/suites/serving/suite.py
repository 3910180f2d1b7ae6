"""`loraserve bench --suite serving` (the default suite): loraserve against its ablations and two
baselines, on S-LoRA's synthetic workload.

    loraserve bench --quick --out /tmp/bench-quick
    loraserve bench --n-adapters 1 10 100 1000 --rates 20 10 30 40 --duration 60 --out results/
    loraserve bench --trace trace.jsonl --systems loraserve peft --out results/

Settings: every --n-adapters value at the first of --rates (throughput against the number of
adapters, S-LoRA fig. 5), then every other rate at --rate-sweep-n adapters (against the request
rate, fig. 6). For each setting one trace is generated (or --trace is replayed) and every system
replays it in real time, in this process, on the same base model and the same adapters. The
baselines (peft, merge-and-swap) are skipped above --baseline-max-adapters adapters.

Writes --out/results.json (a record per system and setting; the ratios and targets of `report.py`),
records.jsonl (one per request), vs_adapters.png / vs_rate.png, and prints a table and the ratios.

The other suites: `loraserve bench --suite NAME` (bench/cli.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from loraserve.bench.common.engine_run import quiet
from loraserve.bench.common.metrics import summarize
from loraserve.bench.common.preset import Preset
from loraserve.bench.common.results import publish, write_jsonl
from loraserve.bench.common.settings import add_settings
from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.bench.suites.serving.report import BASELINES, STACK, print_report, ratios, targets
from loraserve.bench.systems.base import ReplayLimits, System
from loraserve.bench.systems.engine import LORASERVE_VARIANTS, AdapterBank, engine_variant
from loraserve.bench.workloads.slora import DEFAULT_RANKS, Trace, WorkloadSpec, load_trace, save_trace, synthetic_trace
from loraserve.config_cli import setting
from loraserve.demo.assets import DEMO_MODEL_DIR
from loraserve.worker.config import EngineConfig

log = logging.getLogger(__name__)

SYSTEMS = (*LORASERVE_VARIANTS, STACK, *BASELINES)


@dataclass(frozen=True)
class ServingPreset(Preset):
    """What `--quick` and the full run set; each flag left unset (None) takes its preset's value."""

    n_adapters: tuple[int, ...]
    rates: tuple[float, ...]
    rate_sweep_n: int
    duration: float
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    drain: float
    pool_pages: int


FULL = ServingPreset((1, 10, 100, 1000), (40.0, 20.0, 60.0, 80.0), 100, 60.0, (8, 64), (8, 64), 60.0, 768)
QUICK = ServingPreset((1, 100, 1000), (60.0, 30.0, 120.0), 100, 5.0, (8, 32), (8, 24), 3.0, 384)
PRESET_FIELDS = tuple(f.name for f in dataclasses.fields(ServingPreset))


def _preset(key: str) -> str:
    return f"(full: {getattr(FULL, key)}; quick: {getattr(QUICK, key)})"


@dataclass(frozen=True)
class ServingSettings:
    """The serving suite's flags, which the other suites that share the bench's flags read too."""

    quick: bool = setting(False, "a small preset that runs in a few minutes on 2 CPU cores")
    n_adapters: tuple[int, ...] | None = setting(None, f"adapter counts {_preset('n_adapters')}", nargs="+")
    rates: tuple[float, ...] | None = setting(
        None, f"request rates R, req/s; the first is the adapter sweep's {_preset('rates')}", nargs="+"
    )
    rate_sweep_n: int | None = setting(None, f"adapters for the other rates {_preset('rate_sweep_n')}")
    alpha: float = setting(1.0, "power-law exponent of adapter popularity")
    cv: float = setting(1.0, "coefficient of variation of inter-arrival times")
    duration: float | None = setting(None, f"trace duration, seconds {_preset('duration')}")
    input_len: tuple[int, ...] | None = setting(
        None, f"prompt length range {_preset('input_len')}", nargs=2, metavars=("LOW", "HIGH")
    )
    output_len: tuple[int, ...] | None = setting(
        None, f"output length range {_preset('output_len')}", nargs=2, metavars=("LOW", "HIGH")
    )
    ranks: tuple[int, ...] = setting(DEFAULT_RANKS, "adapter ranks, round-robin", nargs="+")
    seed: int = setting(0, "")
    systems: tuple[str, ...] = setting(SYSTEMS, f"systems to compare: {' '.join(SYSTEMS)}", nargs="+", metavar="SYSTEM")
    baseline_max_adapters: int = setting(100, "skip peft and merge-and-swap above this many adapters")
    trace: Path | None = setting(None, "replay this JSON-lines trace instead of generating")
    save_trace: Path | None = setting(None, "write each generated trace here (-n<N>-r<R> added if several)")
    out: Path | None = setting(None, "directory for results.json, records.jsonl and the plots")
    slo: float = setting(1.0, "SLO on the first-token latency, seconds (S-LoRA: 6 s for a 7B model on an A100)")
    drain: float | None = setting(None, f"seconds after the last arrival; then stragglers are cut {_preset('drain')}")
    model: Path = setting(DEMO_MODEL_DIR, "base model directory")
    adapter_cache: Path | None = setting(None, "where synthetic adapter directories are written once")
    max_batch_size: int = setting(32, "running requests per step / per static batch")
    pool_pages: int | None = setting(
        None, f"engine pool pages (16 KV tokens or 32 adapter rows each) {_preset('pool_pages')}"
    )
    split_adapter_fraction: float | None = setting(
        None,
        "adapters' share of the pool in loraserve-no-unified-pool (default: what is left "
        "after KV room for a full batch of the longest requests)",
    )
    threads: int = setting(1, "torch CPU threads")
    no_progress: bool = setting(False, "no progress bars")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serving suite's flags (`ServingSettings`)."""
    add_settings(parser, ServingSettings)


@dataclass(frozen=True)
class Setting:
    n_adapters: int
    rate: float


def _resolved(args: argparse.Namespace) -> argparse.Namespace:
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:  # checked here, not with choices=, so the LORASERVE_SYSTEMS=a,b twin works too
        raise SystemExit(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    preset = (QUICK if args.quick else FULL).but(**{key: getattr(args, key) for key in PRESET_FIELDS})
    for key in PRESET_FIELDS:
        setattr(args, key, getattr(preset, key))
    return args


def settings(args: argparse.Namespace) -> list[Setting]:
    out = [Setting(n, args.rates[0]) for n in args.n_adapters]
    out += [Setting(args.rate_sweep_n, rate) for rate in args.rates[1:]]
    return list(dict.fromkeys(out))


def build_system(name: str, args: argparse.Namespace, bank: AdapterBank, limits: ReplayLimits) -> System:
    if name in LORASERVE_VARIANTS:
        config = EngineConfig(
            device="cpu", max_batch_size=args.max_batch_size, pool_pages=args.pool_pages, seed=args.seed
        )
        return engine_variant(name, args.model, config, bank, limits, split_fraction(args))
    if name == STACK:
        from loraserve.bench.systems.stack import StackSystem

        return StackSystem(bank.adapters, args.pool_pages, args.max_batch_size, limits, torch_threads=args.threads)
    if name == "peft":
        from loraserve.bench.systems.peft import PeftSystem

        return PeftSystem(bank.adapters, args.adapter_cache, args.max_batch_size, limits)
    from loraserve.bench.systems.merge import MergeSwapSystem

    return MergeSwapSystem(bank.adapters, args.max_batch_size, limits)


def split_fraction(args: argparse.Namespace) -> float:
    """The static split S-LoRA's no-unified-memory variant stands for, sized generously: KV keeps
    exactly enough pages for a full batch of the longest requests, adapters get the rest."""
    if args.split_adapter_fraction is not None:
        return args.split_adapter_fraction
    tokens_per_page = EngineConfig().rows_per_page // 2  # a KV page holds K and V rows per token
    longest = args.input_len[1] + args.output_len[1]
    kv_pages = args.max_batch_size * -(-longest // tokens_per_page)
    return min(0.9, max(0.1, 1 - kv_pages / args.pool_pages))


def _trace_for(setting: Setting, args: argparse.Namespace, many: bool) -> Trace:
    spec = WorkloadSpec(
        n_adapters=setting.n_adapters,
        alpha=args.alpha,
        rate=setting.rate,
        cv=args.cv,
        duration_s=args.duration,
        input_len=tuple(args.input_len),
        output_len=tuple(args.output_len),
        ranks=tuple(args.ranks),
        seed=args.seed,
    )
    trace = synthetic_trace(spec)
    if args.save_trace:
        path = args.save_trace
        if many:
            path = path.with_name(f"{path.stem}-n{setting.n_adapters}-r{setting.rate:g}{path.suffix}")
        save_trace(trace, path)
    return trace


def run_benchmark(args: argparse.Namespace) -> list[dict]:
    """Every system on every setting; one result row each."""
    import torch

    torch.set_num_threads(args.threads)
    limits = ReplayLimits(drain_s=args.drain, progress=not args.no_progress)
    bank = AdapterBank(SyntheticAdapters(args.model, seed=args.seed))
    if args.trace:
        trace = load_trace(args.trace, seed=args.seed)
        jobs = [(Setting(len(trace.adapters), float(trace.params.get("rate", 0.0))), trace)]
    else:
        jobs = [(s, None) for s in settings(args)]
    rows, records, systems = [], [], {}
    began = time.perf_counter()
    for point, given in jobs:
        trace = given or _trace_for(point, args, len(jobs) > 1)
        for name in args.systems:
            if name in BASELINES and point.n_adapters > args.baseline_max_adapters:
                continue
            if name not in systems:  # one instance per system: the PEFT one keeps its loaded adapters
                systems[name] = build_system(name, args, bank, limits)
            system = systems[name]
            start = time.perf_counter()
            result = system.run(trace)
            row = {
                "system": name,
                "n_adapters": point.n_adapters,
                "alpha": trace.params.get("alpha", args.alpha),
                "cv": trace.params.get("cv", args.cv),
                "rate": point.rate,
                "duration_s": trace.duration_s,
                "offered_req_per_s": round(len(trace.requests) / trace.duration_s, 3) if trace.duration_s else None,
                "seed": args.seed,
                "adapters_used": len(trace.used_adapters()),
                "pool_pages": args.pool_pages,
                "adapter_pool_fraction": split_fraction(args) if name == "loraserve-no-unified-pool" else None,
                **summarize(result, args.slo),
                **system.stats(),
                "wall_s": round(time.perf_counter() - start, 2),
            }
            rows.append(row)
            records += [
                {"system": name, "n_adapters": point.n_adapters, "rate": point.rate, **r.as_dict()} for r in result
            ]
            shown = ("req_per_s", "tokens_per_s", "ttft_p50_s", "slo_attainment", "finished", "requests")
            log.info("%s n=%d rate=%g: %s", name, point.n_adapters, point.rate, {k: row[k] for k in shown})
    if args.out:
        _write(args, rows, records, round(time.perf_counter() - began, 1))
    return rows


PRESET_KEYS = ("quick", *PRESET_FIELDS, "alpha", "cv", "ranks", "seed", "max_batch_size", "slo", "model", "trace")


def _write(args: argparse.Namespace, rows: list[dict], records: list[dict], run_s: float) -> None:
    """results.json (the rows, the settings, the run's wall time, the ratios the report prints and
    the targets), records.jsonl (one line per request) and the plots."""
    from loraserve.bench.suites.serving.plots import plot_results

    out, rate = args.out, rows[0]["rate"] if rows else 0.0
    settings = {key: getattr(args, key) for key in PRESET_KEYS}
    fields = {"settings": settings, "run_s": run_s, "ratios": dict(ratios(rows, rate)), "targets": targets(rows, rate)}
    publish(out, "serving", rows, args.threads, **fields)
    write_jsonl(out / "records.jsonl", records)
    for path in plot_results(rows, out):
        log.info("wrote %s", path)


def main(args: argparse.Namespace) -> int:
    args = _resolved(args)
    quiet(None, "transformers", "peft")  # one line per adapter registered is too many
    rows = run_benchmark(args)
    print_report(rows, rows[0]["rate"] if rows else 0.0)
    return 0
