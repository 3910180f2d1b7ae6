"""The base model's GEMMs two ways on this CPU: torch's default `F.linear` and the engine's `DenseLinear`.

    python -m loraserve.bench.suites.overhead.gemm --out docs/overhead/gemm     # about a minute

One step's projections of a Llama (`--hidden/--layers/--heads/--kv-heads/--intermediate`; default the
52M shape the peer suite serves), fused as the engine fuses them (q/k/v, o, gate/up, down per layer),
random float32 weights, for each row count in `ROWS` (decode batches to prefill chunks): the median
milliseconds of all of them with `F.linear` on the fused weights and with `DenseLinear` (oneDNN's
reordered weights where this machine has oneDNN, `worker/dense.py`), their ratio, and the largest
difference between the two outputs. Records: `rows, threads, f_linear_ms, dense_ms, speedup,
max_abs_diff, onednn`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from loraserve.bench.common.results import write_results
from loraserve.bench.common.settings import add_settings, config_from_args
from loraserve.bench.common.stats import median_seconds
from loraserve.config_cli import setting
from loraserve.worker.dense import DenseLinear

ROWS = (1, 4, 8, 16, 32, 64, 256, 1024)
REPEATS = 5


def fused_shapes(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> list[tuple[int, int]]:
    """(d_out, d_in) of each GEMM of one step, as the engine fuses them."""
    kv = kv_heads * hidden // heads
    return [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)] * layers


@torch.inference_mode()
def measure(shapes: list[tuple[int, int]], rows: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o, i, generator=g) * 0.02 for o, i in shapes]
    dense = [DenseLinear([w], [None]) for w in weights]
    inputs = {i: torch.randn(rows, i, generator=g) for i in {i for _, i in shapes}}
    plain = 1e3 * median_seconds(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights], REPEATS)
    packed = 1e3 * median_seconds(lambda: [d(inputs[w.shape[1]]) for d, w in zip(dense, weights, strict=True)], REPEATS)
    diff = max(
        (F.linear(inputs[w.shape[1]], w) - d(inputs[w.shape[1]])[0]).abs().max().item()
        for d, w in zip(dense[:4], weights[:4], strict=True)
    )
    return {
        "rows": rows,
        "threads": torch.get_num_threads(),
        "f_linear_ms": round(plain, 3),
        "dense_ms": round(packed, 3),
        "speedup": round(plain / packed, 3),
        "max_abs_diff": diff,
        "onednn": dense[0].onednn,
    }


@dataclass(frozen=True)
class GemmSettings:
    out: Path = setting(Path("results"), "write OUT/results.json")
    threads: tuple[int, ...] = setting((1, 2), "torch threads, each measured in turn", nargs="+")
    rows: tuple[int, ...] = setting(ROWS, "row counts (tokens of a step)", nargs="+")
    hidden: int = setting(768, "the model's hidden size")
    layers: int = setting(8, "decoder layers")
    heads: int = setting(12, "attention heads")
    kv_heads: int = setting(4, "KV heads")
    intermediate: int = setting(2048, "MLP width")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_settings(parser, GemmSettings)
    args = config_from_args(GemmSettings, parser.parse_args(argv))
    shapes = fused_shapes(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate)
    records = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            records.append(measure(shapes, rows))
            print(records[-1], flush=True)
    model = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate")}
    write_results(args.out, "overhead-gemm", records, model=model)


if __name__ == "__main__":
    main()
