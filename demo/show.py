"""`loraserve demo`: the demo model and every adapter, all in one continuous batch of the engine."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from loraserve.config_cli import add_config_arguments, setting
from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.demo.corpus import HELD_OUT_PROMPTS
from loraserve.demo.styles import STYLES, shows_style
from loraserve.worker.config import EngineConfig
from loraserve.worker.engine import Engine, GenerateRequest
from loraserve.worker.sampling import SamplingParams


@dataclass(frozen=True)
class ShowSettings:
    """`loraserve demo`'s settings."""

    prompt: str = setting(HELD_OUT_PROMPTS[0], "prompt every adapter continues")
    max_new_tokens: int = setting(32, "")
    device: str = setting(EngineConfig.device, "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ShowSettings)


def main(args: argparse.Namespace) -> int:
    console = Console()
    engine = Engine(DEMO_MODEL_DIR, EngineConfig(device=args.device, pool_pages=512))
    for name, path in demo_adapters().items():
        engine.register_adapter(name, path)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
    names = [None, *engine.registry.names()]
    start = time.perf_counter()
    results = engine.generate([GenerateRequest(prompt=args.prompt, adapter=n, sampling=sampling) for n in names])
    elapsed = time.perf_counter() - start

    table = Table(title=f"prompt: {args.prompt!r} - base model and {len(names) - 1} adapters in one batch")
    for column in ("adapter", "rank", "targets", "continuation", "style?"):
        table.add_column(column, overflow="fold")
    for result in results:
        style = result.adapter or "plain"
        adapter = engine.registry.get(engine.registry.latest(result.adapter)) if result.adapter else None
        table.add_row(
            result.adapter or "(base)",
            str(adapter.rank) if adapter else "-",
            ",".join(m.removesuffix("_proj") for m in adapter.modules) if adapter else "-",
            result.text.strip(),
            f"{STYLES[style].description}: {'yes' if shows_style(style, result.text) else 'NO'}",
        )
    console.print(table)
    tokens = sum(len(r.token_ids) for r in results)
    pool = engine.stats()["pool"]
    console.print(
        f"{tokens} tokens in {engine.steps} steps, {elapsed:.2f} s "
        f"({tokens / elapsed:.0f} tokens/s on {engine.device}); "
        f"pool: {pool['adapter_pages']} adapter pages, {pool['free_pages']} free, waste {pool['waste_fraction']:.1%}"
    )
    return 0
