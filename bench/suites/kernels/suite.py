"""GPU benchmark of the batched LoRA kernels against two torch baselines and the bandwidth roofline.

    loraserve bench --suite kernels [--ranks 16 64 128 mixed] [--batch-sizes 1 8 64 256]
        [--popularity distinct uniform zipf identical] [--phases decode prefill] [--hidden 4096]
        [--bandwidth TB/s] [--out DIR]
    loraserve bench --suite kernels --gpu-suite [--out DIR]     LoRA and attention, the GPU suite's part
    loraserve bench --suite kernels --dry-run [--out DIR]   the same on CPU, tiny shapes, interpreter

For each (phase, rank, batch size, popularity): a batch of requests (one token each decoding, --prefill-len
each prefilling, at most --max-prefill-tokens in all: larger batches get fewer per request, said in the
row's note), adapters assigned by punica's popularity patterns, packed in random pages of one pool, one
projection hidden -> hidden. Rank "mixed": adapter i has rank (8, 16, 32, 64, 128)[i mod 5], so a batch
of several adapters mixes ranks in one launch (identical uses adapter 0 alone, rank 8).
Measured in the same run:

    triton   lora_apply_triton (the token path for decode-shaped steps, the segment path otherwise)
    loop     lora_apply_torch, the engine's torch path (adapters bucketed by rank and token count, one gather
             of A and B per bucket, then bmm; planned once, as the engine does per step: not timed)
    bmm      lora_apply_bmm: every adapter gathered padded to the largest rank, then torch.bmm (eager only)
    roofline (T*d_in + 2*T*d_out + sum over distinct adapters r_a*(d_in + d_out)) * itemsize / bandwidth

Times (microseconds, medians): *_us, an eager call under triton.testing.do_bench, L2 flushed before each
(host-side launch cost included where it exceeds the device time); *_graph_us, the device time of one call
captured in a CUDA graph, L2 flushed (256 MiB zeroed) before each replay, None when capture fails.

Bandwidth: a device-to-device copy of 1 GiB, (bytes read + bytes written) / time, median of 5; the
datasheet figure (H100 SXM 3.35, H200 4.8 TB/s) is reported beside it. Every case is also checked
once: Triton's output against the torch loop's (max_abs_err, rel_err = ||t - l||_F / ||l||_F).

Without CUDA, exits with status 2 (unless --dry-run). DIR/results.json: `results.py`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.bench.common.kernel_cases import POPULARITIES
from loraserve.bench.common.settings import add_settings
from loraserve.bench.suites.kernels.lora import PHASES, SUITE_BATCH_SIZES, SUITE_RANKS
from loraserve.bench.suites.kernels.report import run_suite, run_sweep
from loraserve.bench.suites.kernels.results import write_report
from loraserve.config_cli import setting


def parse_rank(text: str) -> int | str:
    """A rank spec: a positive int, or "mixed"."""
    if text == "mixed":
        return text
    try:
        rank = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"rank must be a positive integer or 'mixed', got {text!r}") from None
    if rank < 1:
        raise argparse.ArgumentTypeError(f"rank must be >= 1, got {rank}")
    return rank


@dataclass(frozen=True)
class KernelsSettings:
    """The kernels suite's flags (its own alone); `LoraConfig.from_args` reads the sweep's from them."""

    ranks: tuple[int | str, ...] = setting(SUITE_RANKS, "ranks, or 'mixed'", nargs="+", flag_type=parse_rank)
    batch_sizes: tuple[int, ...] = setting(SUITE_BATCH_SIZES, "requests per case", nargs="+")
    popularity: tuple[str, ...] = setting(POPULARITIES, "adapter popularity", nargs="+", choices=POPULARITIES)
    phases: tuple[str, ...] = setting(PHASES, "prefill and/or decode cases", nargs="+", choices=PHASES)
    prefill_len: int = setting(64, "tokens per request in prefill cases")
    max_prefill_tokens: int = setting(4096, "cap on a prefill case's tokens")
    hidden: int = setting(4096, "d_in = d_out of the projection")
    row_width: int = setting(1024, "pool row width (the KV width)")
    rows_per_page: int = setting(32, "pool rows per page")
    dtype: str = setting("float16", "the tensors' dtype", choices=("float16", "bfloat16"))
    bandwidth: float | None = setting(
        None, "bandwidth in TB/s for the roofline (default: measured by a device-to-device copy)"
    )
    rep: int = setting(20, "do_bench repetition time, ms")
    gpu_suite: bool = setting(False, "run the GPU suite's sweep (LoRA and attention)")
    dry_run: bool = setting(False, "the suite on CPU: tiny shapes, Triton's interpreter")
    out: Path | None = setting(None, "write DIR/results.json")


SETTINGS = KernelsSettings


def invalid(args: argparse.Namespace) -> str | None:
    """What is wrong with the sizes asked for, or None."""
    for name in ("batch_sizes", "prefill_len", "max_prefill_tokens"):
        value = getattr(args, name)
        if min(value if isinstance(value, list) else [value]) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`loraserve bench --suite kernels ARGV`'s flags, checked."""
    p = argparse.ArgumentParser(prog="loraserve bench --suite kernels", description=__doc__.splitlines()[0])
    add_settings(p, SETTINGS)
    args = p.parse_args(argv)
    if (problem := invalid(args)) is not None:
        p.error(problem)
    return args


def main(args: argparse.Namespace) -> int:
    if (problem := invalid(args)) is not None:
        raise SystemExit(f"loraserve bench --suite kernels: {problem}")
    if args.dry_run:
        report = run_suite(dry_run=True)
    elif not torch.cuda.is_available():
        print("the kernel benchmark needs a CUDA device (none is available)", file=sys.stderr)
        return 2
    elif args.gpu_suite:
        report = run_suite()
    else:
        report = run_sweep(args)
    print(report["markdown"])
    if args.out is not None:
        rows = "results" if "results" in report else "lora"
        print(f"results: {write_report(args.out, 'kernels', report, rows)}", file=sys.stderr)
    return 0
