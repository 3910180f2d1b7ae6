"""`loraserve bench --suite overhead`: what LoRA costs over the base model, in the offline engine.

    loraserve bench --suite overhead --quick --out /tmp/overhead     # a few minutes on 2 CPU cores
    loraserve bench --suite overhead --out results/                   # three models, n = 1000

Per model, the same requests run with adapters and with none, alternately, in one process: `batch`
requests queued at once (prompts of 8–32 random tokens, 16–128 output tokens, greedy, EOS ignored),
request i using adapter i mod n (32 distinct adapters of ranks 8/16/32 on q/k/v/o by default). Each
side runs `repeats` times and keeps its fastest run, so both are measured under the same conditions.
The pool is sized from the model to hold a full batch's KV and every adapter at once, and every
adapter is copied in before the clock starts: no run loads or evicts one. Models: the demo model and
random Llamas of ~25M and ~100M parameters (`bench/common/random_model.py`, written once and cached).

Then, on the ~25M model (else the first model measured), the scaling ratio: LoRA tokens/s with n distinct
adapters (1000; 200 in --quick) over one adapter, saturated (every request queued at once, batch 64).

On CUDA (`--overhead-device cuda`), each model is measured with CUDA graphs and with eager steps.

A record's `kind` is `overhead` (`overhead` = LoRA time / base time - 1, `host_ms_per_step` the
runner's host-side planning), `scaling`, or with --overhead-breakdown, on the scaling model,
`gather` and `profile` (`breakdown.py`).
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from loraserve.bench.common.engine_run import alternate, bench_cache, quiet
from loraserve.bench.common.preset import Preset
from loraserve.bench.common.results import publish
from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.bench.common.tables import rich_table, wide_console
from loraserve.bench.systems.engine import AdapterBank, adapter_counters, warmed_engine
from loraserve.bench.workloads.slora import round_robin_ranks
from loraserve.config_cli import setting
from loraserve.worker.config import ADAPTER_DTYPES

log = logging.getLogger(__name__)

OVERHEAD_RANKS = (8, 16, 32)
PROMPT_LEN = (8, 32)


@dataclass(frozen=True)
class OverheadPreset(Preset):
    models: tuple[str, ...]
    repeats: int
    output_len: tuple[int, int]
    scaling_n: int
    scaling_requests: int
    scaling_output: int


FULL = OverheadPreset(("demo", "random-25m", "random-100m"), 3, (16, 128), 1000, 256, 32)
QUICK = OverheadPreset(("demo", "random-25m"), 2, (16, 64), 200, 128, 16)
PROFILE_STEPS = 10  # decode steps profiled per side (--overhead-breakdown)


@dataclass(frozen=True)
class OverheadSettings:
    """The overhead suite's own flags (it also reads the shared --quick, --out, --threads, ...)."""

    overhead_batch: int = setting(64, "overhead suite: requests queued at once")
    overhead_adapters: int = setting(32, "overhead suite: distinct adapters")
    overhead_models: tuple[str, ...] | None = setting(
        None, "overhead suite: demo, random-25m, random-100m (default: the preset's)", nargs="+"
    )
    overhead_scaling_n: int | None = setting(None, "overhead suite: distinct adapters of the scaling ratio")
    overhead_output_len: tuple[int, ...] | None = setting(None, "overhead suite: output tokens, low high", nargs=2)
    overhead_repeats: int | None = setting(None, "overhead suite: runs per side, the fastest kept")
    overhead_device: str = setting("cpu", "overhead suite: the engine's device (cpu, cuda)")
    overhead_backend: str = setting(
        "auto", "overhead suite: the engine's kernel backend", choices=["auto", "torch", "triton", "torch-bmm"]
    )
    overhead_adapter_dtype: str = setting("pool", "overhead suite: engine --adapter-dtype", choices=ADAPTER_DTYPES)
    overhead_breakdown: bool = setting(
        False, "overhead suite: also the pool's gather bandwidth and a profile of base and LoRA decode steps"
    )


SETTINGS = OverheadSettings


def _requests(batch: int, output_len: tuple[int, int], seed: int) -> list[tuple[list[int], int]]:
    """(prompt of random token ids, output tokens) per request, seeded."""
    rng = random.Random(seed)
    low, high = PROMPT_LEN
    return [
        ([rng.randrange(3, 1000) for _ in range(rng.randrange(low, high + 1))], rng.randint(*output_len))
        for _ in range(batch)
    ]


def pool_pages(path: Path, batch: int, longest: int, adapters: dict[str, int], modules: tuple[str, ...]) -> int:
    """Pages for a full batch of KV at `longest` tokens each plus every adapter resident at once,
    with a quarter to spare (prefetch leaves a share free for KV; the padded steps keep a page)."""
    from loraserve.model_config import ModelConfig
    from loraserve.worker.config import EngineConfig
    from loraserve.worker.pool_layout import PoolLayout

    config = ModelConfig.from_dir(path)
    layout = PoolLayout.for_model(config, EngineConfig().rows_per_page, 1)
    per_rank = {r: layout.adapter_layout(config, r, modules).num_pages for r in set(adapters.values())}
    need = batch * layout.kv_pages_for(longest) + sum(per_rank[r] for r in adapters.values())
    return need + need // 4 + 8


def _run(engine, requests, adapters: list[str | None]) -> dict:
    """Every request queued at once, run to the end: seconds, steps, host seconds, adapter bytes."""
    from loraserve.worker.sampling import SamplingParams

    steps0, host0, read0 = engine.steps, engine.runner.host_seconds, engine.adapter_bytes_read
    loads0 = adapter_counters(engine)["loads"]
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(requests):
        sampling = SamplingParams(max_new_tokens=n, ignore_eos=True, seed=0)
        engine.add_request(prompt, sampling, adapters[i % len(adapters)], f"r{time.monotonic_ns()}-{i}")
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    seconds = time.perf_counter() - start
    steps = engine.steps - steps0
    return {
        "seconds": seconds,
        "steps": steps,
        "tokens": tokens,
        "host_s": engine.runner.host_seconds - host0,
        "adapter_bytes": engine.adapter_bytes_read - read0,
        "adapter_loads": adapter_counters(engine)["loads"] - loads0,
    }


def _alternated(
    path: Path,
    args: argparse.Namespace,
    adapters: dict[str, int],
    requests: list[tuple[list[int], int]],
    sides: list[list[str | None]],
    repeats: int,
    cuda_graphs: str = "auto",
):
    """(engine, runs per side): one engine whose pool holds every adapter and a full batch's KV,
    warmed up with every adapter resident, then the same requests once per side, `repeats` times
    round, so that every side is measured under the same conditions."""
    longest = PROMPT_LEN[1] + max(n for _, n in requests)
    with closing(_prepared_engine(path, args, adapters, longest, cuda_graphs)) as engine:
        runs = alternate(repeats, range(len(sides)), lambda i: _run(engine, requests, sides[i]))
    return engine, list(runs.values())


def _prepared_engine(path: Path, args: argparse.Namespace, adapters: dict[str, int], longest: int, cuda_graphs: str):
    """An engine whose pool holds every adapter and a full batch's KV at `longest` tokens, warmed up
    with every adapter resident."""
    from loraserve.worker.config import EngineConfig

    bank = AdapterBank(SyntheticAdapters(path, seed=args.seed))
    pages = pool_pages(path, args.overhead_batch, longest, adapters, bank.adapters.target_modules)
    config = EngineConfig(
        device=args.overhead_device,
        backend=args.overhead_backend,
        adapter_dtype=args.overhead_adapter_dtype,
        cuda_graphs=cuda_graphs,
        max_batch_size=args.overhead_batch,
        pool_pages=pages,
    )
    return warmed_engine(path, config, bank, adapters, lambda engine: _load_all(engine, list(adapters)))


def _load_all(engine, names: list[str]) -> None:
    """One one-token request per adapter, all queued at once: every adapter is copied into the pool."""
    from loraserve.worker.sampling import SamplingParams

    sampling = SamplingParams(max_new_tokens=1, ignore_eos=True)
    for i, name in enumerate(names):
        engine.add_request([5, 6, 7, 8], sampling, name, f"load-{i}")
    while engine.has_unfinished():
        engine.step()


def _engine_fields(engine, args: argparse.Namespace) -> dict:
    """What a record says of the engine that ran it."""
    return {
        "device": str(engine.device),
        "backend": engine.runner.backend.name,
        "adapter_dtype": args.overhead_adapter_dtype,
        "cuda_graphs": engine.runner.graphs is not None,
        "threads": args.threads,
    }


def measure_overhead(
    name: str, path: Path, args: argparse.Namespace, preset: OverheadPreset, cuda_graphs: str = "auto"
) -> dict:
    """One model: the same requests with adapters and without, alternately; the fastest of each."""
    adapters = round_robin_ranks(args.overhead_adapters, OVERHEAD_RANKS)
    requests = _requests(args.overhead_batch, preset.output_len, args.seed)
    names = list(adapters)
    engine, (base, lora) = _alternated(path, args, adapters, requests, [[None], names], preset.repeats, cuda_graphs)
    b, lo = min(base, key=lambda r: r["seconds"]), min(lora, key=lambda r: r["seconds"])
    if b["tokens"] != lo["tokens"]:
        raise RuntimeError(f"{name}: base run generated {b['tokens']} tokens, LoRA run {lo['tokens']}")
    parameters = engine.model.parameter_count
    if lo["adapter_loads"]:
        log.warning("%s: the kept LoRA run loaded %d adapters", name, lo["adapter_loads"])
    return {
        "kind": "overhead",
        "model": name,
        "parameters": parameters,
        **_engine_fields(engine, args),
        "n_adapters": len(names),
        "ranks": list(OVERHEAD_RANKS),
        "batch": args.overhead_batch,
        "tokens": b["tokens"],
        "tokens_per_s_base": round(b["tokens"] / b["seconds"], 1),
        "tokens_per_s_lora": round(lo["tokens"] / lo["seconds"], 1),
        "overhead": round(lo["seconds"] / b["seconds"] - 1, 4),
        "steps_base": b["steps"],
        "steps_lora": lo["steps"],
        "step_ms_base": round(1000 * b["seconds"] / b["steps"], 3),
        "step_ms_lora": round(1000 * lo["seconds"] / lo["steps"], 3),
        "host_ms_per_step": round(1000 * lo["host_s"] / lo["steps"], 3),
        "adapter_mb_per_step": round(lo["adapter_bytes"] / lo["steps"] / 2**20, 2),
        "base_mb_per_step": round(engine.base_bytes / 2**20, 2),
        "adapter_loads": lo["adapter_loads"],
        "pool_pages": engine.layout.num_pages,
    }


def measure_scaling(name: str, path: Path, args: argparse.Namespace, preset: OverheadPreset) -> dict:
    """LoRA tokens/s with n distinct adapters over one adapter, the same saturated requests."""
    n = args.overhead_scaling_n or preset.scaling_n
    adapters = round_robin_ranks(n, OVERHEAD_RANKS)
    requests = _requests(preset.scaling_requests, (preset.scaling_output, preset.scaling_output), args.seed)
    sides = [[next(iter(adapters))], list(adapters)]
    engine, (one, many) = _alternated(path, args, adapters, requests, sides, preset.repeats)
    t1 = max(r["tokens"] / r["seconds"] for r in one)
    tn = max(r["tokens"] / r["seconds"] for r in many)
    return {
        "kind": "scaling",
        "model": name,
        **_engine_fields(engine, args),
        "n_adapters": n,
        "ranks": list(OVERHEAD_RANKS),
        "batch": args.overhead_batch,
        "requests": len(requests),
        "tokens_per_s_n1": round(t1, 1),
        "tokens_per_s_n": round(tn, 1),
        "ratio": round(tn / t1, 3),
    }


def measure_breakdown(name: str, path: Path, args: argparse.Namespace) -> list[dict]:
    """The gather-bandwidth record for the model's pool rows, and a profile of its decode steps with
    no adapter and with `overhead_adapters` distinct ones (`breakdown.py`)."""
    from loraserve.bench.suites.overhead.breakdown import PROMPT_LEN as PROFILE_PROMPT
    from loraserve.bench.suites.overhead.breakdown import gather_bandwidth, pool_row_bytes, profile_decode

    adapters = round_robin_ranks(args.overhead_adapters, OVERHEAD_RANKS)
    steps = PROFILE_STEPS
    with closing(_prepared_engine(path, args, adapters, PROFILE_PROMPT + 2 * steps + 8, "auto")) as engine:
        sides = [profile_decode(engine, [], "base", steps), profile_decode(engine, list(adapters), "lora", steps)]
    fields = {"model": name, **_engine_fields(engine, args), "ranks": list(OVERHEAD_RANKS)}
    return [{**gather_bandwidth(*pool_row_bytes(path)), "model": name}, *({**s, **fields} for s in sides)]


def print_report(records: list[dict]) -> None:
    columns = ("model", "cuda_graphs", "n_adapters", "batch", "tokens_per_s_base", "tokens_per_s_lora", "overhead")
    columns += ("step_ms_base", "step_ms_lora", "host_ms_per_step", "adapter_mb_per_step")
    cells = [[str(r[c]) for c in columns] for r in records if r["kind"] == "overhead"]
    console = wide_console(160)
    console.print(rich_table("LoRA overhead (offline engine)", columns, cells, left={"model"}))
    for r in records:
        if r["kind"] == "scaling":
            console.print(
                f"{r['model']}: n={r['n_adapters']} / n=1, saturated: {r['tokens_per_s_n']} / {r['tokens_per_s_n1']}"
                f" tokens/s = {r['ratio']}"
            )
        elif r["kind"] == "gather":
            console.print(
                f"gather, {r['threads']} thread(s): {r['row_bytes']}-byte rows {r['rows_gbps']} GB/s, "
                f"{r['page_bytes']}-byte pages {r['pages_gbps']} GB/s, contiguous {r['contiguous_gbps']} GB/s"
            )
        elif r["kind"] == "profile":
            top = ", ".join(f"{o['op']} {o['ms_per_step']}" for o in r["top"][:6])
            console.print(f"{r['model']} {r['side']} decode step {r['wall_ms_per_step']} ms; profiled ms: {top}")


def main(args: argparse.Namespace) -> int:
    import torch

    from loraserve.bench.common.random_model import model_dir

    preset = (QUICK if args.quick else FULL).but(
        models=tuple(args.overhead_models or ()) or None,
        repeats=args.overhead_repeats or None,
        output_len=tuple(args.overhead_output_len or ()) or None,
    )
    quiet(args.threads)
    cache = bench_cache(args.adapter_cache)
    records = []
    # on CUDA, each model with decode graphs and without (--enforce-eager); a CPU has none
    graph_modes = ("auto", "off") if args.overhead_device.startswith("cuda") else ("auto",)
    for name in preset.models:
        for graphs in graph_modes:
            records.append(measure_overhead(name, model_dir(name, cache), args, preset, graphs))
            log.info("overhead %s: %s", name, records[-1])
    scaling = "random-25m" if "random-25m" in preset.models else preset.models[0]
    records.append(measure_scaling(scaling, model_dir(scaling, cache), args, preset))
    if args.overhead_breakdown:
        records += measure_breakdown(scaling, model_dir(scaling, cache), args)
    print_report(records)
    if args.out:
        machine = None
        if args.overhead_device.startswith("cuda"):
            machine = {"gpu": torch.cuda.get_device_name(torch.device(args.overhead_device))}
        publish(args.out, "overhead", records, args.threads, machine_extra=machine)
    return 0
