"""`loraserve bench --suite prefix`: prefix caching on multi-turn chat, with the cache on and off.

    loraserve bench --suite prefix --quick --out /tmp/prefix     # about a minute on 2 CPU cores
    loraserve bench --suite prefix --out results/prefix          # 20 adapters, 2 tenants: several minutes

In the offline engine on the ~25M-parameter random Llama (`bench/common/random_model.py`; the demo
model's 512 positions hold no 512-token system prompt and a conversation after it), the two
workloads of `workloads.py`: multi-turn chats (each adapter with a system prompt of `system_tokens`;
`conversations` per adapter and tenant, of `turns` turns; tenants are the cache salt, so they share
nothing) and never-repeated prompts. Each runs with the cache on and off in two engines of one
process, stepped in turn, each timed by its own clock (`timeline.py`). A record is a workload and
cache side's `Timeline.summary`; `ratios` holds the on/off ratios, `targets` the verdicts
(`targets.py`).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from loraserve.bench.common.engine_run import bench_cache, quiet
from loraserve.bench.common.preset import Preset
from loraserve.bench.common.results import publish
from loraserve.bench.suites.prefix.targets import ratios, targets
from loraserve.bench.suites.prefix.workloads import WORKLOADS
from loraserve.config_cli import setting

log = logging.getLogger(__name__)
MODEL = "random-25m"


@dataclass(frozen=True)
class PrefixPreset(Preset):
    adapters: int
    tenants: int
    conversations: int  # per adapter and tenant
    turns: int
    system_tokens: int
    user_tokens: int
    answer_tokens: int
    concurrency: int
    model: str = MODEL  # `bench/common/random_model.py`'s models: "demo" or a random Llama


FULL = PrefixPreset(adapters=20, tenants=2, conversations=1, turns=4, system_tokens=512, user_tokens=32,
              answer_tokens=32, concurrency=16)  # fmt: skip
QUICK = PrefixPreset(adapters=4, tenants=2, conversations=1, turns=4, system_tokens=512, user_tokens=32,
               answer_tokens=16, concurrency=8)  # fmt: skip


@dataclass(frozen=True)
class PrefixSettings:
    """The prefix suite's own flag (it also reads the shared --quick, --out, --threads, ...)."""

    prefix_adapters: int | None = setting(None, "prefix suite: adapters (each with its own system prompt)")


SETTINGS = PrefixSettings


def _engine(path: Path, preset: PrefixPreset, cache: bool, seed: int):
    from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
    from loraserve.bench.systems.engine import AdapterBank
    from loraserve.worker.config import EngineConfig
    from loraserve.worker.engine import Engine

    longest = preset.system_tokens + preset.turns * (preset.user_tokens + preset.answer_tokens)
    pages = preset.concurrency * (-(-longest // 16)) * 3 + preset.adapters * 8  # room to keep what was computed
    config = EngineConfig(device="cpu", prefix_cache=cache, pool_pages=pages, max_batch_size=preset.concurrency)
    engine = Engine(path, config)
    bank = AdapterBank(SyntheticAdapters(path, seed=seed))
    for i in range(preset.adapters):
        engine.adapters.add(f"a{i}", bank.get(f"a{i}", (8, 16, 32)[i % 3]))
    return engine


def measure(path: Path, preset: PrefixPreset, seed: int) -> list[dict]:
    """Each workload with the cache on and off: two engines, stepped in turn (one step of each, the
    side that goes first alternating)."""
    records = []
    for workload, run_type in WORKLOADS.items():
        engines = {cache: _engine(path, preset, cache, seed) for cache in (True, False)}
        runs = {cache: run_type(engine, preset, seed) for cache, engine in engines.items()}
        order = list(runs.values())
        while not all(run.done for run in order):
            for run in order:
                if not run.done:
                    run.advance()
            order.reverse()  # on, off, off, on, on, off...: neither side always steps right after the other
        for cache, run in runs.items():
            engines[cache].close()
            record = {"workload": workload, "cache": "on" if cache else "off", **run.timeline.summary()}
            log.info("prefix %s cache=%s: %s", workload, record["cache"], record)
            records.append(record)
    return records


def main(args: argparse.Namespace) -> int:
    from loraserve.bench.common.random_model import model_dir

    preset = (QUICK if args.quick else FULL).but(adapters=args.prefix_adapters or None)
    quiet(args.threads)
    cache = bench_cache(args.adapter_cache)
    records = measure(model_dir(preset.model, cache), preset, args.seed)
    for r in records:
        print(
            f"{r['workload']:>10} cache {r['cache']:>3}: TTFT p50 {_ms(r['ttft_p50_s'])}, p99 "
            f"{_ms(r['ttft_p99_s'])}, {r['tokens_per_s']:.0f} tokens/s, hit rate {r['hit_rate']:.2f}"
        )
    summary = ratios(records)
    for name, value in summary.items():
        print(f"{name}: {'–' if value is None else f'{value:.2f}'}")
    fields = {"model": preset.model, "preset": vars(preset), "ratios": summary, "targets": targets(summary)}
    publish(args.out, "prefix", records, threads=args.threads, **fields)
    return 0


def _ms(seconds: float | None) -> str:
    return "– (none completed)" if seconds is None else f"{seconds * 1e3:.0f} ms"
