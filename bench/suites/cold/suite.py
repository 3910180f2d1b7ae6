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

from loraserve.bench.common.engine_run import bench_cache
from loraserve.bench.common.results import write_results
from loraserve.bench.suites.cold.targets import targets
from loraserve.config_cli import setting

FULL_RANKS = (8, 16, 32, 64, 128)


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
    import torch

    from loraserve.bench.common.random_model import model_dir
    from loraserve.bench.suites.cold.load import PATHS, measure_load
    from loraserve.bench.suites.cold.stack import StackSettings, measure_stack

    torch.set_num_threads(args.threads)
    cache = bench_cache(args.adapter_cache)
    records: list[dict] = []
    if "load" in args.cold_parts:
        for record in measure_load(10 if args.quick else 30, PATHS):
            records.append({"part": "load", **record})
            print(record)
    if "stack" in args.cold_parts:
        trials = args.cold_trials or (4 if args.quick else 12)
        ranks = (8, 64) if args.quick else FULL_RANKS
        options = tuple(_option(s) for s in args.cold_stack_option)
        settings = StackSettings(
            ranks, trials, prompt_words=32, new_tokens=4, torch_threads=args.threads, stack_options=options
        )
        for model in args.cold_models or ["demo", "random-100m"]:
            for record in measure_stack(model_dir(model, cache), settings):
                records.append({"part": "stack", "model": model, **record})
                print(records[-1])
    if args.out:
        verdicts = targets(records)
        for t in verdicts:
            print(f"{t['name']}: {t['value']} ({t['goal']}): {'met' if t['met'] else 'missed'}")
        path = write_results(
            args.out, "cold", records, threads=args.threads, targets=verdicts, options=args.cold_stack_option
        )
        print(f"results: {path}")
    return 0
