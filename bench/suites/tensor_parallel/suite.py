"""`loraserve bench --suite tensor-parallel`: one engine split over N ranks, its speed and its communication.

    loraserve bench --suite tensor-parallel --quick --out /tmp/tp       # a few minutes on 2 CPU cores
    loraserve bench --suite tensor-parallel --out docs/tensor-parallel  # --tp-sizes 1 2 4 --tp-device cuda

Per model and ranks count N (`--tp-sizes`; on the CPU the ranks are processes on one machine, over gloo),
one offline engine runs the same `--tp-batch` requests (prompts of 8-32 random tokens, `--tp-output`
tokens, greedy, EOS ignored) on three sides, alternately: the base model, 16 adapters of rank 16 on all
seven projections, and for N > 1 the same adapters with the LoRA exchanges skipped
(`LORASERVE_TP_LORA_COMM=off`: wrong outputs, the time without LoRA communication, S-LoRA's figure 8).
Each side keeps its fastest of `repeats` runs. The LoRA overhead is LoRA time / base time - 1.

Communication: one prefill step of `--tp-batch` tokens with one rank-16 adapter on all projections; the
bytes rank 0 sent for the base model and for LoRA, against the closed forms (S-LoRA, 6.2; B tokens, hidden
h, L layers): base L·2·2(N-1)Bh/N (the o and down all-reduces), LoRA L·9(N-1)Br/N (the q/k/v and gate/up
shrinks all-gathered, 3 + 2, the o and down shrinks all-reduced, 2 + 2; attention alone 5(N-1)Br/N).
The same step loads the adapter: the bytes of its rows rank 0 handed rank 1 (its part alone) against the
adapter's whole rows.

DIR/results.json: records of kind `speed` {model, size, side, tokens, seconds, tokens_per_s, steps} and
`traffic` {model, size, tokens, base_bytes, lora_bytes, base_formula, lora_formula, lora_share,
adapter_part_bytes, adapter_whole_bytes}; targets: measured bytes equal to the formulas, LoRA's share of the
base model's bytes <= 10 % at rank 16, and a rank's part of an adapter <= 1/N of its rows.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from loraserve.bench.common.engine_run import bench_cache, quiet
from loraserve.bench.common.preset import Preset
from loraserve.bench.common.random_model import model_dir
from loraserve.bench.common.results import target, write_results
from loraserve.bench.common.synthetic_adapters import SyntheticAdapters
from loraserve.bench.systems.engine import AdapterBank
from loraserve.config_cli import setting
from loraserve.model_config import LORA_MODULES
from loraserve.worker.pool_layout import PoolLayout

RANK = 16
ADAPTERS = 16
SIDES = ("base", "lora", "lora-no-comm")


@dataclass(frozen=True)
class TensorParallelPreset(Preset):
    output: int  # tokens per request
    repeats: int  # runs per side, the fastest kept


FULL, QUICK = TensorParallelPreset(output=48, repeats=3), TensorParallelPreset(output=24, repeats=2)


@dataclass(frozen=True)
class TensorParallelSettings:
    """The suite's own flags (it also reads --quick, --out, --threads, --adapter-cache, --seed)."""

    tp_sizes: tuple[int, ...] = setting((1, 2), "tensor-parallel suite: ranks counts", nargs="+", flag_type=int)
    tp_models: tuple[str, ...] | None = setting(
        None, "tensor-parallel suite: demo, random-25m, random-100m (default: demo random-25m)", nargs="+"
    )
    tp_batch: int = setting(16, "tensor-parallel suite: requests queued at once")
    tp_output: int | None = setting(None, "tensor-parallel suite: output tokens per request (default 48; quick 24)")
    tp_repeats: int | None = setting(None, "tensor-parallel suite: runs per side, fastest kept (default 3; quick 2)")
    tp_device: str = setting("cpu", "tensor-parallel suite: the engine's device (cpu, cuda)")


SETTINGS = TensorParallelSettings


def _engine(path: Path, size: int, device: str, batch: int, bank: AdapterBank, lora_comm: bool = True):
    from loraserve.worker.config import EngineConfig
    from loraserve.worker.engine import Engine

    os.environ["LORASERVE_TP_LORA_COMM"] = "on" if lora_comm else "off"  # the other ranks inherit it
    config = EngineConfig(device=device, tensor_parallel=size, max_batch_size=batch, pool_pages=4096)
    engine = Engine(path, config)
    for i in range(ADAPTERS):
        engine.adapters.add(f"a{i}", bank.get(f"a{i}", RANK))
    return engine


def _requests(batch: int, output: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 1000) for _ in range(rng.randrange(8, 33))], output) for _ in range(batch)]


def _run(engine, requests, lora: bool) -> dict:
    from loraserve.worker.sampling import SamplingParams

    steps0, start, tokens = engine.steps, time.perf_counter(), 0
    for i, (prompt, n) in enumerate(requests):
        adapter = f"a{i % ADAPTERS}" if lora else None
        engine.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), adapter)
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    seconds = time.perf_counter() - start
    record = {"tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1)}
    return record | {"steps": engine.steps - steps0}


def _speed(path: Path, size: int, args, bank: AdapterBank, requests, repeats: int) -> list[dict]:
    """The fastest run of each side, round after round. The side without LoRA communication runs in an
    engine of its own, started after the other is closed (one split engine per process at a time)."""
    runs: dict[str, list[dict]] = {side: [] for side in SIDES if size > 1 or side != "lora-no-comm"}
    for _ in range(repeats):
        for lora_comm in (True, False) if size > 1 else (True,):
            with closing(_engine(path, size, args.tp_device, args.tp_batch, bank, lora_comm)) as engine:
                _run(engine, requests[:4], True)  # first-call costs
                for side, lora in (("base", False), ("lora", True)) if lora_comm else (("lora-no-comm", True),):
                    runs[side].append(_run(engine, requests, lora))
    return [{"side": side} | min(done, key=lambda r: r["seconds"]) for side, done in runs.items()]


def _traffic(path: Path, size: int, args, bank: AdapterBank) -> dict:
    """One prefill step of `tp_batch` tokens with one rank-16 adapter on all projections: the bytes sent."""
    from loraserve.worker.sampling import SamplingParams

    with closing(_engine(path, size, args.tp_device, args.tp_batch, bank)) as engine:
        engine.add_request(list(range(3, 3 + args.tp_batch)), SamplingParams(max_new_tokens=1), "a0")
        before = (engine.leader.collectives.traffic.base, engine.leader.collectives.traffic.lora)
        engine.step()
        traffic = engine.leader.collectives.traffic
        config, element = engine.model_config, engine.dtype.itemsize
        part = engine.leader.channel.rows_sent.get(1, 0)  # rank 1's part of a0, handed over at its load
        whole = bank.get("a0", RANK).pack(PoolLayout.for_model(config, 2, 1), config, engine.dtype).nbytes
    b, h, n, layers = args.tp_batch, config.hidden_size, size, config.num_layers
    base, lora = traffic.base - before[0], traffic.lora - before[1]
    return {
        "tokens": b,
        "base_bytes": base,
        "lora_bytes": lora,
        "base_formula": layers * 2 * 2 * (n - 1) * b * h // n * element,
        "lora_formula": layers * 9 * (n - 1) * b * RANK // n * element,
        "lora_share": round(lora / base, 4),
        "adapter_part_bytes": part,
        "adapter_whole_bytes": whole,
    }


def main(args: argparse.Namespace) -> int:
    quiet(args.threads, "loraserve.worker.tensor_parallel")
    preset = (QUICK if args.quick else FULL).but(output=args.tp_output, repeats=args.tp_repeats)
    records, targets = [], []
    for name in args.tp_models or ("demo", "random-25m"):
        path = model_dir(name, bench_cache(args.adapter_cache))
        bank = AdapterBank(SyntheticAdapters(path, target_modules=LORA_MODULES, seed=args.seed))
        requests = _requests(args.tp_batch, preset.output, args.seed)
        for size in args.tp_sizes:
            for record in _speed(path, size, args, bank, requests, preset.repeats):
                records.append({"kind": "speed", "model": name, "size": size} | record)
                print(records[-1], flush=True)
            if size > 1:
                records.append({"kind": "traffic", "model": name, "size": size} | _traffic(path, size, args, bank))
                print(records[-1], flush=True)
                targets += _targets(records[-1])
    options = {"batch": args.tp_batch, "output": preset.output, "repeats": preset.repeats}
    options |= {"rank": RANK, "adapters": ADAPTERS}
    path = write_results(Path(args.out), "tensor-parallel", records, args.threads, targets=targets, options=options)
    print(f"tensor-parallel suite: {path}")
    return 0


def _targets(t: dict) -> list[dict]:
    where = f"{t['model']}, N = {t['size']}"
    share, limit = round(t["adapter_part_bytes"] / t["adapter_whole_bytes"], 4), 1 / t["size"]
    exact = t["base_bytes"] == t["base_formula"] and t["lora_bytes"] == t["lora_formula"]
    return [
        target(f"bytes sent = the closed forms ({where})", "equal", f"{t['base_bytes']}/{t['lora_bytes']}", exact),
        target(f"LoRA bytes / base bytes at rank {RANK} ({where})", "<= 0.10", t["lora_share"], t["lora_share"] <= 0.1),
        target(f"an adapter's bytes to rank 1 / its whole rows ({where})", f"<= 1/{t['size']}", share, share <= limit),
    ]
