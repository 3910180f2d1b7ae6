"""Engine flags (shared by every command that builds an engine) and `loraserve generate`."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from loraserve.config_cli import add_config_arguments, config_from_args, setting
from loraserve.demo.assets import DEMO_MODEL_DIR, demo_adapters
from loraserve.demo.model_settings import ModelSettings
from loraserve.errors import LoraserveError
from loraserve.params import SamplingParams
from loraserve.tokenizer import IncrementalDetokenizer
from loraserve.worker.config import EngineConfig

WORKER_ADAPTER_CACHE_GB = 4.0  # a worker's default: thousands of typical adapters, bounded all the same
WORKER_ENGINE_DEFAULTS = {"adapter_cache_bytes": int(WORKER_ADAPTER_CACHE_GB * 2**30)}
_SAMPLING = SamplingParams()  # generate's sampling defaults are the engine's (but for max_new_tokens)


@dataclass(frozen=True)
class GenerateSettings:
    """`loraserve generate`'s own settings (the engine's are EngineConfig's)."""

    prompt: str = setting(help="prompt text ('-' reads standard input)", flag="prompt")
    adapter: str | None = setting(None, "adapter name (default: the base model)")
    adapter_dir: tuple[str, ...] = setting(
        (),
        "register a PEFT adapter directory (repeatable; the demo adapters are registered with the demo model)",
        metavar="NAME=PATH",
    )
    max_new_tokens: int = setting(48, "")
    temperature: float = setting(_SAMPLING.temperature, "")
    top_k: int = setting(_SAMPLING.top_k, "")
    top_p: float = setting(_SAMPLING.top_p, "")
    seed: int | None = setting(_SAMPLING.seed, "")


def add_engine_arguments(
    parser: argparse.ArgumentParser, adapter_cache_gb: float | None = WORKER_ADAPTER_CACHE_GB
) -> None:
    """The engine's flags (`EngineConfig`'s settings and the model). `adapter_cache_gb=None` leaves out
    --adapter-cache-gb: an engine without an adapter store to fetch evicted adapters back from
    (`loraserve generate`) must keep them all."""
    g = parser.add_argument_group("engine")
    add_config_arguments(g, ModelSettings)
    if adapter_cache_gb is None:
        add_config_arguments(g, EngineConfig, skip={"adapter_cache_bytes"})
    elif adapter_cache_gb == WORKER_ADAPTER_CACHE_GB:
        add_config_arguments(g, EngineConfig, defaults=WORKER_ENGINE_DEFAULTS)
    else:
        add_config_arguments(g, EngineConfig, defaults={"adapter_cache_bytes": int(adapter_cache_gb * 2**30)})


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(EngineConfig, args)


def parse_adapter_specs(specs: list[str]) -> dict[str, Path]:
    """["name=path", ...] -> {name: path}."""
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--adapter-dir {spec!r}: expected NAME=PATH")
        out[name] = Path(path)
    return out


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser, adapter_cache_gb=None)
    add_config_arguments(parser, GenerateSettings)


def generate_main(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    from loraserve.worker.engine import Engine

    try:
        engine = Engine(args.model, engine_config_from_args(args))
        adapters = parse_adapter_specs(args.adapter_dir)
        if Path(args.model).resolve() == DEMO_MODEL_DIR.resolve():
            adapters = {**demo_adapters(), **adapters}
        for name, path in adapters.items():
            engine.register_adapter(name, path)
        sampling = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
        prompt_ids = engine.tokenizer.encode(prompt)
        request = engine.add_request(prompt_ids, sampling, args.adapter)
    except LoraserveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    detok = IncrementalDetokenizer(engine.tokenizer, prompt_ids)
    sys.stdout.write(prompt)
    while not request.finished:
        for out in engine.step():
            for token in out.new_token_ids:
                if token not in engine.tokenizer.eos_token_ids:
                    sys.stdout.write(detok.push(token))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    print(f"[{request.finish_reason}: {len(request.output_ids)} tokens]", file=sys.stderr)
    return 0 if request.error is None else 1
