"""How the in-process engine's throughput changes with the number of adapters.

    loraserve bench --suite engine-scaling [--adapters 1 10 100 1000] [--requests 1000]
        [--prompt-len 16] [--output-len 32] [--max-batch-size 32] [--ranks 64 32 16 8] [--out DIR]

The same requests (same prompts, same output lengths, greedy, EOS ignored) run offline — all
queued at once, continuous batching to the end — once per adapter count n; request i uses
adapter i mod n, so with n >= the batch size every running request has its own adapter (the
worst case for batched LoRA). Reported per n: output tokens/s, mean step time and batch size,
the pool's waste fraction (mean over steps), adapter loads and prefetch hits; then
throughput(largest n) / throughput(smallest n) — the target is >= 0.9 — and the same ratio were a
step to cost only the bytes of weights it reads (`bytes_ratio`).

results.json: a record per adapter count, beside "ratio", "bytes_ratio", "settings" and "targets".
"""

from __future__ import annotations

import argparse
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loraserve.bench.common.engine_run import quiet
from loraserve.bench.common.results import judged, publish
from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.bench.systems.engine import AdapterBank, adapter_counters, adapter_stats_since, warmed_engine
from loraserve.bench.workloads.slora import DEFAULT_RANKS, FIRST_TOKEN_ID, round_robin_ranks
from loraserve.config_cli import setting
from loraserve.demo.assets import DEMO_MODEL_DIR

TARGET = 0.9


def measure(
    n_adapters: int, bank: AdapterBank, prompts: list[list[int]], output_len: int, config, ranks: tuple[int, ...]
) -> dict:
    """One engine, n adapters, every request queued at once; returns throughput and pool numbers."""
    from loraserve.worker.sampling import SamplingParams

    names = list(round_robin_ranks(n_adapters, ranks).items())
    sampling = SamplingParams(max_new_tokens=output_len, ignore_eos=True, seed=0)
    with closing(warmed_engine(bank.adapters.model_dir, config, bank, dict(names))) as engine:
        counters0, steps0, read0 = adapter_counters(engine), engine.steps, engine.adapter_bytes_read
        waste, batch = [], []  # per step
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, sampling, names[i % n_adapters][0], f"req-{i}")
        while engine.has_unfinished():
            batch.append(len(engine.step()))  # requests that got a token this step
            waste.append(engine.stats()["pool"]["waste_fraction"])
        elapsed = time.perf_counter() - start
        adapter_stats = adapter_stats_since(engine, counters0)
    tokens = len(prompts) * output_len
    steps = engine.steps - steps0
    adapter_bytes = (engine.adapter_bytes_read - read0) / max(steps, 1)
    return {
        "n_adapters": n_adapters,
        "tokens_per_s": round(tokens / elapsed, 1),
        "seconds": round(elapsed, 3),
        "steps": steps,
        "step_ms": round(1000 * elapsed / steps, 3),
        "mean_batch_size": round(float(np.mean(batch)), 2) if batch else 0.0,
        "pool_waste_fraction": round(float(np.mean(waste)), 4) if waste else 0.0,
        **{k: adapter_stats[k] for k in ("adapter_loads", "adapter_misses", "adapter_evictions", "prefetch_hit_rate")},
        "base_mb_per_step": round(engine.base_bytes / 2**20, 2),
        "adapter_mb_per_step": round(adapter_bytes / 2**20, 2),  # distinct adapters' weights a step reads
    }


def run(args: argparse.Namespace) -> dict:
    from loraserve.worker.config import EngineConfig

    rng = np.random.default_rng(args.seed)
    prompts = [[int(t) for t in rng.integers(FIRST_TOKEN_ID, 1024, size=args.prompt_len)] for _ in range(args.requests)]
    config = EngineConfig(
        device=args.device,
        backend=args.backend,
        max_batch_size=args.max_batch_size,
        pool_pages=args.pool_pages,
        prefetch=not args.no_prefetch,
    )
    bank = AdapterBank(SyntheticAdapters(args.model, seed=args.seed))
    rows = []
    for n in sorted(set(args.adapters)):
        rows.append(measure(n, bank, prompts, args.output_len, config, tuple(args.ranks)))
        r = rows[-1]
        print(
            f"n={n:5d}  {r['tokens_per_s']:8.1f} tok/s  step {r['step_ms']:6.2f} ms  batch {r['mean_batch_size']:5.1f}"
            f"  waste {r['pool_waste_fraction']:.4f}  loads {r['adapter_loads']}"
            f"  prefetch hit rate {r['prefetch_hit_rate']}",
            flush=True,
        )
    first, last = rows[0], rows[-1]
    ratio = round(last["tokens_per_s"] / first["tokens_per_s"], 3)
    # What the ratio would be if a step cost only the bytes of weights it reads (base + its distinct
    # adapters): the ceiling for large, memory-bound models; tiny models are bound by per-call overhead.
    first_mb, last_mb = (r["base_mb_per_step"] + r["adapter_mb_per_step"] for r in (first, last))
    bound = round(first_mb / last_mb, 3)
    verdict = "meets" if ratio >= TARGET else "misses"
    print(
        f"throughput(n={last['n_adapters']}) / throughput(n={first['n_adapters']}) = {ratio} "
        f"({verdict} the {TARGET} target); reading the weights alone would give {bound} "
        f"({last['adapter_mb_per_step']:.1f} MB of adapters vs {last['base_mb_per_step']:.1f} MB of base "
        "weights per step)"
    )
    settings = {k: v for k, v in vars(args).items() if k in EngineScalingSettings.__dataclass_fields__}
    return {"rows": rows, "ratio": ratio, "bytes_ratio": bound, "settings": settings, "targets": targets(rows, ratio)}


def targets(rows: list[dict], ratio: float) -> list[dict]:
    """The target: throughput at the largest adapter count over the smallest, >= TARGET."""
    name = f"throughput(n={rows[-1]['n_adapters']}) / throughput(n={rows[0]['n_adapters']})"
    return [judged(name, f">= {TARGET}", ratio)]


@dataclass(frozen=True)
class EngineScalingSettings:
    """The engine-scaling suite's flags (its own alone)."""

    adapters: tuple[int, ...] = setting((1, 10, 100, 1000), "adapter counts", nargs="+")
    requests: int = setting(1000, "requests per adapter count")
    prompt_len: int = setting(16, "prompt tokens per request")
    output_len: int = setting(32, "output tokens per request")
    max_batch_size: int = setting(32, "running requests per step")
    ranks: tuple[int, ...] = setting(DEFAULT_RANKS, "adapter ranks, round-robin", nargs="+")
    pool_pages: int = setting(1024, "engine pool pages")
    device: str = setting("cpu", "cpu or cuda")
    backend: str = setting("torch", "the engine's kernel backend", choices=["torch", "torch-bmm", "triton"])
    no_prefetch: bool = setting(False, "no adapter prefetch")
    threads: int = setting(1, "torch CPU threads")
    model: Path = setting(DEMO_MODEL_DIR, "base model directory")
    seed: int = setting(0, "")
    out: Path | None = setting(None, "write DIR/results.json")


SETTINGS = EngineScalingSettings


def main(args: argparse.Namespace) -> int:
    quiet(args.threads)
    result = run(args)
    publish(args.out, "engine-scaling", result.pop("rows"), threads=args.threads, **result)
    return 0
