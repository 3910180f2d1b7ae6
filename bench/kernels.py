"""GPU benchmark of the batched LoRA kernels against two torch baselines and the bandwidth roofline.

    python -m loraserve.bench.kernels [--ranks 8 16 32 64] [--batch-sizes 1 2 4 8 16 32 64]
        [--popularity distinct uniform zipf identical] [--phases decode prefill] [--hidden 4096]
        [--bandwidth TB/s] [--json OUT]

For each (phase, rank, batch size, popularity): a batch of requests (one token each when decoding,
--prefill-len tokens each when prefilling), adapters assigned by punica's popularity patterns, all
packed in random pages of one pool, one projection hidden -> hidden. Measured in the same run:

    triton   lora_apply_triton (the token path for decode-shaped steps, the segment path otherwise)
    loop     lora_apply_torch, the engine's torch path: per adapter segment, gather A and B from the
             pool and two torch matmuls (or, for many short segments, its per-token "pairs" form).
             Its index plan is cached in the batch during warm-up, as the engine builds it once
             per step and reuses it in every layer; planning is not in the figure.
    bmm      lora_apply_bmm: gather every adapter padded to the largest rank, then torch.bmm
    roofline bytes that must move / peak bandwidth:
             (T*d_in + 2*T*d_out + sum over distinct adapters r*(d_in + d_out)) * itemsize / bw

Latencies come from triton.testing.do_bench (CUDA events, median). Needs CUDA: exits with status 2
without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from loraserve.kernels.lora_bmm import lora_apply_bmm
from loraserve.kernels.lora_torch import lora_apply_torch
from loraserve.kernels.synthetic import (
    POPULARITIES,
    LoraGeometry,
    adapters_used,
    assign_adapters,
    make_lora_batch,
    make_lora_pool,
)

PEAK_BANDWIDTH_TBS = {"H200": 4.8, "H100": 3.35}  # by device-name substring, HBM3e / HBM3 (SXM)
Timer = Callable[[Callable[[], None]], float]  # fn -> milliseconds


@dataclass(frozen=True)
class Case:
    phase: str  # decode | prefill
    rank: int
    batch_size: int
    popularity: str


@dataclass
class Result:
    phase: str
    rank: int
    batch_size: int
    popularity: str
    tokens: int
    adapters: int  # distinct adapters in the batch
    triton_us: float
    loop_us: float
    bmm_us: float
    roofline_us: float | None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loraserve.bench.kernels", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--popularity", nargs="+", choices=POPULARITIES, default=list(POPULARITIES))
    p.add_argument("--phases", nargs="+", choices=("decode", "prefill"), default=["decode", "prefill"])
    p.add_argument("--prefill-len", type=int, default=64, help="tokens per request in prefill cases")
    p.add_argument("--hidden", type=int, default=4096, help="d_in = d_out of the projection")
    p.add_argument("--row-width", type=int, default=1024, help="pool row width (the KV width)")
    p.add_argument("--rows-per-page", type=int, default=32)
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    p.add_argument(
        "--bandwidth", type=float, default=None,
        help="peak memory bandwidth in TB/s (default: H100 3.35, H200 4.8, from the device name)",
    )  # fmt: skip
    p.add_argument("--rep", type=int, default=50, help="do_bench repetition time, ms")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results as JSON")
    args = p.parse_args(argv)
    for name in ("ranks", "batch_sizes"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def default_bandwidth(device_name: str) -> float | None:
    """Peak bandwidth in TB/s for a known device name, else None."""
    return next((tbs for key, tbs in PEAK_BANDWIDTH_TBS.items() if key in device_name), None)


def cases(args: argparse.Namespace) -> list[Case]:
    return [
        Case(phase, rank, bs, pop)
        for phase in args.phases
        for rank in args.ranks
        for bs in args.batch_sizes
        for pop in args.popularity
    ]


def run_case(case: Case, args: argparse.Namespace, device: torch.device, timer: Timer) -> Result:
    """Build the case's pool and batch on `device` and time the three implementations with `timer`."""
    from loraserve.kernels.lora_triton import lora_apply_triton

    dtype = getattr(torch, args.dtype)
    geometry = LoraGeometry.uniform(args.hidden, args.hidden, args.row_width, args.rows_per_page)
    assigned = assign_adapters(case.popularity, case.batch_size, seed=case.batch_size)
    n = max(assigned) + 1
    pool, adapters = make_lora_pool(geometry, [case.rank] * n, [(0,)] * n, dtype, device=device)
    tokens = 1 if case.phase == "decode" else args.prefill_len
    requests = [(a, tokens) for a in sorted(assigned)]  # grouped by adapter, as the scheduler batches them
    batch = make_lora_batch(geometry, adapters, requests, device=device)
    assert batch is not None
    num_tokens = tokens * case.batch_size
    x = torch.randn(num_tokens, args.hidden, device=device).to(dtype)
    y = torch.zeros(num_tokens, args.hidden, device=device, dtype=dtype)
    layer = pool[0]

    def timed(fn: Callable) -> float:
        return timer(lambda: fn(y, x, layer, batch, 0, 0)) * 1e3

    distinct = len(adapters_used(requests))
    itemsize = torch.finfo(dtype).bits // 8
    moved = (num_tokens * 3 * args.hidden + distinct * case.rank * 2 * args.hidden) * itemsize
    return Result(
        case.phase, case.rank, case.batch_size, case.popularity, num_tokens, distinct,
        triton_us=timed(lora_apply_triton), loop_us=timed(lora_apply_torch), bmm_us=timed(lora_apply_bmm),
        roofline_us=moved / (args.bandwidth * 1e12) * 1e6 if args.bandwidth else None,
    )  # fmt: skip


def format_table(results: list[Result]) -> str:
    head = (
        f"{'phase':<8}{'rank':>5}{'batch':>6} {'popularity':<10}{'tokens':>7}{'adapt':>6}"
        f"{'triton us':>11}{'loop us':>10}{'bmm us':>10}{'roof us':>9}{'x loop':>8}{'x bmm':>7}{'% roof':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        roof = f"{r.roofline_us:9.1f}" if r.roofline_us is not None else f"{'-':>9}"
        share = f"{100 * r.roofline_us / r.triton_us:7.0f}" if r.roofline_us is not None else f"{'-':>7}"
        lines.append(
            f"{r.phase:<8}{r.rank:>5}{r.batch_size:>6} {r.popularity:<10}{r.tokens:>7}{r.adapters:>6}"
            f"{r.triton_us:11.1f}{r.loop_us:10.1f}{r.bmm_us:10.1f}{roof}"
            f"{r.loop_us / r.triton_us:8.2f}{r.bmm_us / r.triton_us:7.2f}{share}"
        )
    return "\n".join(lines)


def benchmark(args: argparse.Namespace, device: torch.device, timer: Timer) -> list[Result]:
    results = []
    for case in cases(args):
        results.append(run_case(case, args, device, timer))
        print(format_table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("the kernel benchmark needs a CUDA device (none is available)", file=sys.stderr)
        return 2
    import triton.testing

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    if args.bandwidth is None:
        args.bandwidth = default_bandwidth(name)
    results = benchmark(args, device, lambda fn: triton.testing.do_bench(fn, rep=args.rep))
    bw = f"{args.bandwidth} TB/s" if args.bandwidth else "unknown (pass --bandwidth)"
    print(f"\n{name}, {args.dtype}, h={args.hidden}, peak bandwidth {bw}\n")
    print(format_table(results))
    if args.json is not None:
        meta = {"device": name, "dtype": args.dtype, "hidden": args.hidden, "bandwidth_tbs": args.bandwidth}
        args.json.write_text(json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
