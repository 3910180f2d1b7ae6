"""`loraserve bench --suite choices`: n choices of one prompt, with shared prefill and without.

    loraserve bench --suite choices --quick --out /tmp/choices     # seconds on 2 CPU cores
    loraserve bench --suite choices --out results/choices

In the offline engine, n requests with one long prompt (random token ids) and one adapter, each
with its own seed, are queued at once and run to the end: once as one prefill group (the prompt is
computed once, the other choices copy its KV), once as n unrelated requests, alternately, each side
keeping its fastest of `repeats` runs. Measured: the tokens the engine computed before every choice
had its first token, the time until then (the last choice's time to first token), and the time
until every choice ended. The prefix cache is off: the runs repeat one prompt. Models: the demo
model and the ~25M-parameter random Llama of the overhead suite (`bench/common/random_model.py`).

A record is a model's figures, shared and alone, and their speedups (alone ÷ shared).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

from loraserve.bench.common.engine_run import alternate, bench_cache, quiet
from loraserve.bench.common.preset import Preset
from loraserve.bench.common.results import publish
from loraserve.config_cli import setting


@dataclass(frozen=True)
class ChoicesPreset(Preset):
    models: tuple[str, ...]
    n: int
    prompt_len: int
    new_tokens: int
    repeats: int


FULL = ChoicesPreset(("demo", "random-25m"), n=8, prompt_len=384, new_tokens=32, repeats=3)
QUICK = ChoicesPreset(("demo",), n=4, prompt_len=256, new_tokens=16, repeats=2)


@dataclass(frozen=True)
class ChoicesSettings:
    """The choices suite's own flag (it also reads --quick, --out, --threads, --seed, --adapter-cache)."""

    choices_n: int | None = setting(None, "choices suite: choices per prompt")


SETTINGS = ChoicesSettings


def _run(engine, prompt: list[int], n: int, new_tokens: int, grouped: bool, seed: int) -> dict:
    """The n choices to their end: tokens computed and seconds until every one had its first token,
    and seconds until all ended."""
    from loraserve.worker.sampling import SamplingParams

    requests = [
        engine.add_request(
            prompt,
            SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed + i, ignore_eos=True),
            "bench",
            group="choices" if grouped else None,
        )
        for i in range(n)
    ]
    started = time.perf_counter()
    computed, first = 0, None
    while engine.has_unfinished():
        engine.step()
        if first is None:
            computed += engine.last_step.tokens if engine.last_step else 0
            if all(r.output_ids for r in requests):
                first = time.perf_counter() - started
    return {"prefill_tokens": computed, "ttft_s": first, "total_s": time.perf_counter() - started}


def measure(name: str, path: Path, preset: ChoicesPreset, seed: int) -> dict:
    from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
    from loraserve.bench.systems.engine import AdapterBank
    from loraserve.model_config import ModelConfig
    from loraserve.worker.config import EngineConfig
    from loraserve.worker.engine import Engine

    config = ModelConfig.from_dir(path)
    rng = random.Random(seed)
    prompt = [rng.randrange(3, config.vocab_size) for _ in range(preset.prompt_len)]
    # No prefix cache: every run repeats the prompt, which would find it cached (`--suite prefix` measures that).
    engine = Engine(
        path, EngineConfig(device="cpu", max_batch_size=max(8, preset.n), max_batched_tokens=4096, prefix_cache=False)
    )
    engine.adapters.add("bench", AdapterBank(SyntheticAdapters(path, seed=seed)).get("bench", 16))
    _run(engine, prompt[:16], 2, 2, True, seed)  # warm up, unmeasured
    seeds = iter(seed + 100 * (i // 2) for i in range(2 * preset.repeats))  # one seed a round, both sides
    runs = alternate(
        preset.repeats, (True, False), lambda g: _run(engine, prompt, preset.n, preset.new_tokens, g, next(seeds))
    )
    engine.close()
    shared, alone = (min(runs[grouped], key=lambda r: r["ttft_s"]) for grouped in (True, False))
    return {
        "model": name,
        "n": preset.n,
        "prompt_len": preset.prompt_len,
        "new_tokens": preset.new_tokens,
        "prefill_tokens_shared": shared["prefill_tokens"],
        "prefill_tokens_alone": alone["prefill_tokens"],
        "ttft_ms_shared": 1e3 * shared["ttft_s"],
        "ttft_ms_alone": 1e3 * alone["ttft_s"],
        "total_ms_shared": 1e3 * shared["total_s"],
        "total_ms_alone": 1e3 * alone["total_s"],
        "ttft_speedup": alone["ttft_s"] / shared["ttft_s"],
        "total_speedup": alone["total_s"] / shared["total_s"],
    }


def main(args: argparse.Namespace) -> int:
    from loraserve.bench.common.random_model import model_dir

    preset = (QUICK if args.quick else FULL).but(n=args.choices_n or None)
    quiet(args.threads)
    cache = bench_cache(args.adapter_cache)
    records = [measure(name, model_dir(name, cache), preset, args.seed) for name in preset.models]
    for r in records:
        print(
            f"{r['model']:>11}  n={r['n']} prompt {r['prompt_len']}: prefill tokens {r['prefill_tokens_shared']} "
            f"shared / {r['prefill_tokens_alone']} alone; last first token {r['ttft_ms_shared']:.0f} ms / "
            f"{r['ttft_ms_alone']:.0f} ms ({r['ttft_speedup']:.2f}x); all done {r['total_ms_shared']:.0f} ms / "
            f"{r['total_ms_alone']:.0f} ms ({r['total_speedup']:.2f}x)"
        )
    publish(args.out, "choices", records, threads=args.threads)
    return 0
