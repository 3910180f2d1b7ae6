"""`loraserve bench --suite cold`: what a request whose adapter is resident nowhere pays, and what loading costs.

    loraserve bench --suite cold --quick --out /tmp/cold     # a few minutes on 2 CPU cores
    loraserve bench --suite cold --out results/cold          # demo and the ~92M random model, ranks 8-128

Two parts (`--cold-parts`): `stack` (`stack.py`: cold against warm TTFT on a real stack, per rank, on
the demo model and `random-100m`) and `load` (`load.py`: fetch + load of a 7B-shaped adapter by each
transfer path, against memcpy). A record carries its `part`; `options` the stack's ablation options,
`targets` the verdicts (`targets.py`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from loraserve.bench.common.engine_run import bench_cache, quiet
from loraserve.bench.common.preset import Preset
from loraserve.bench.common.results import publish
from loraserve.bench.suites.cold.targets import targets
from loraserve.config_cli import setting


@dataclass(frozen=True)
class ColdPreset(Preset):
    load_iterations: int  # timed fetch + loads of each path
    ranks: tuple[int, ...]
    trials: int  # cold adapters per rank
    models: tuple[str, ...] = ("demo", "random-100m")


FULL, QUICK = ColdPreset(30, (8, 16, 32, 64, 128), trials=12), ColdPreset(10, (8, 64), trials=4)


@dataclass(frozen=True)
class ColdSettings:
    """The cold suite's own flags (it also reads --quick, --out, --threads, --adapter-cache)."""

    cold_parts: tuple[str, ...] = setting(
        ("stack", "load"), "cold suite: the parts to run", nargs="+", choices=["stack", "load"]
    )
    cold_models: tuple[str, ...] | None = setting(None, "cold suite: models (default: demo random-100m)", nargs="+")
    cold_trials: int | None = setting(None, "cold suite: cold adapters per rank (full 12)")
    cold_stack_option: tuple[str, ...] = setting(
        (),
        "cold suite: a `loraserve up` option for the stack (an ablation, e.g. adapter_rows=False)",
        metavar="NAME=VALUE",
    )


SETTINGS = ColdSettings


def _option(spec: str) -> tuple[str, object]:
    name, _, value = spec.partition("=")
    parsed = {"True": True, "False": False, "None": None}.get(value, value)
    return name.replace("-", "_"), parsed


def main(args: argparse.Namespace) -> int:
    from loraserve.bench.common.random_model import model_dir
    from loraserve.bench.suites.cold.load import PATHS, measure_load
    from loraserve.bench.suites.cold.stack import StackSettings, measure_stack

    models = tuple(args.cold_models) if args.cold_models else None
    preset = (QUICK if args.quick else FULL).but(trials=args.cold_trials, models=models)
    quiet(args.threads)
    cache = bench_cache(args.adapter_cache)
    records: list[dict] = []
    if "load" in args.cold_parts:
        for record in measure_load(preset.load_iterations, PATHS):
            records.append({"part": "load", **record})
            print(record)
    if "stack" in args.cold_parts:
        options = tuple(_option(s) for s in args.cold_stack_option)
        settings = StackSettings(preset.ranks, preset.trials, 32, 4, torch_threads=args.threads, stack_options=options)
        for model in preset.models:
            for record in measure_stack(model_dir(model, cache), settings):
                records.append({"part": "stack", "model": model, **record})
                print(records[-1])
    publish(args.out, "cold", records, args.threads, targets=targets(records), options=args.cold_stack_option)
    return 0
