"""GPU benchmark of the batched LoRA kernels against two torch baselines and the bandwidth roofline.

    loraserve bench --suite kernels [--ranks 16 64 128 mixed] [--batch-sizes 1 8 64 256]
        [--popularity distinct uniform zipf identical] [--phases decode prefill] [--hidden 4096]
        [--bandwidth TB/s] [--out DIR]
    loraserve bench --suite kernels --gpu-suite [--out DIR]     LoRA and attention, the GPU suite's part
    loraserve bench --suite kernels --dry-run [--out DIR]   the same on CPU, tiny shapes, interpreter

For each (phase, rank, batch size, popularity): a batch of requests (one token each when decoding,
--prefill-len tokens each when prefilling, at most --max-prefill-tokens in all: larger batches get
fewer tokens per request, said in the row's note), adapters assigned by punica's popularity patterns,
all packed in random pages of one pool, one projection hidden -> hidden. Rank "mixed": adapter i of
the pool has rank (8, 16, 32, 64, 128)[i mod 5], so a batch of several adapters mixes ranks in one
launch (a distinct batch of >= 5 has all five; identical uses adapter 0 alone, rank 8).
Measured in the same run:

    triton   lora_apply_triton (the token path for decode-shaped steps, the segment path otherwise)
    loop     lora_apply_torch, the engine's torch path: adapters bucketed by rank and token count,
             per bucket one gather of A and B from the pool and torch bmm calls. Its plan is
             prepared once, as the engine prepares it once per step for every layer; planning is
             not in the figure.
    bmm      lora_apply_bmm: gather every adapter padded to the largest rank, then torch.bmm
             (torch.nonzero synchronises: eager only)
    roofline bytes that must move / measured bandwidth:
             (T*d_in + 2*T*d_out + sum over distinct adapters r_a*(d_in + d_out)) * itemsize / bw

Two times per implementation (microseconds, medians):

    *_us        eager call, triton.testing.do_bench (CUDA events around each call, L2 flushed before
                each): what an eager engine pays, host-side launch cost included when it exceeds
                the device time
    *_graph_us  device time: one call captured in a CUDA graph, events around each replay, L2
                flushed (a 256 MiB buffer zeroed) before each replay; None when capture fails

Bandwidth: a device-to-device copy of 1 GiB, (bytes read + bytes written) / time, median of 5; the
datasheet figure (H100 SXM 3.35, H200 4.8 TB/s) is reported beside it. Every case is also checked
once: Triton's output against the torch loop's (max_abs_err, rel_err = ||t - l||_F / ||l||_F).

`run_suite(dry_run)` runs the suite's sweep (LoRA and `attention_bench`) and returns a JSON-able dict
with the rows, a summary of the targets and markdown tables. Without CUDA, exits with status 2
(unless --dry-run).

DIR/results.json (`bench/suites/kernels/results.py`) is {"suite", "machine", "commit", "records",
"targets", "meta", "summary", "markdown"} (and "attention" with --gpu-suite or --dry-run): a record
per LoRA case, the fields of `Result`; the targets computed from the summary.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from loraserve.bench.common.kernel_cases import (
    POPULARITIES,
    LoraGeometry,
    SyntheticAdapter,
    assign_adapters,
    make_bench_lora_pool,
    make_lora_plan,
)
from loraserve.bench.common.settings import add_settings
from loraserve.bench.common.tables import markdown_table
from loraserve.bench.suites.kernels.results import ROOFLINE_FACTOR, write_report
from loraserve.bench.suites.kernels.timing import (
    Fn,
    Timers,
    cuda_timers,
    default_bandwidth,
    measure_bandwidth,
    timed,
    wall_timers,
)
from loraserve.config_cli import setting
from loraserve.kernels.lora_bmm import lora_apply_bmm, prepare_lora_bmm
from loraserve.kernels.lora_torch import lora_apply_torch, prepare_lora_torch

MIXED_RANKS = (8, 16, 32, 64, 128)
PHASES = ("decode", "prefill")
# the GPU suite's sweep
SUITE_RANKS: tuple[int | str, ...] = (16, 64, 128, "mixed")
SUITE_BATCH_SIZES = (1, 8, 64, 256)
SUITE_BUDGET_S = 55.0  # seconds; the part runs under a 70 s limit (gpu_check.GPU_LIMITS_S)
PLACEHOLDER_BANDWIDTH_TBS = 1.0  # dry run: no device to measure


@dataclass(frozen=True)
class Case:
    phase: str  # decode | prefill
    rank: int | str  # a LoRA rank, or "mixed"
    batch_size: int
    popularity: str

    @property
    def label(self) -> str:
        rank = self.rank if self.rank == "mixed" else f"r{self.rank}"
        return f"{self.phase} {rank} b{self.batch_size} {self.popularity}"


@dataclass
class LoraConfig:
    """A LoRA sweep and its shapes (the CLI's arguments, or the suite's)."""

    ranks: list[int | str] = field(default_factory=lambda: list(SUITE_RANKS))
    batch_sizes: list[int] = field(default_factory=lambda: list(SUITE_BATCH_SIZES))
    popularity: list[str] = field(default_factory=lambda: list(POPULARITIES))
    phases: list[str] = field(default_factory=lambda: list(PHASES))
    prefill_len: int = 64
    max_prefill_tokens: int = 4096  # bmm gathers [T, r_max, d] twice: 4 GiB each at r 128, d 4096
    hidden: int = 4096
    row_width: int = 1024
    rows_per_page: int = 32
    dtype: str = "float16"
    mixed_ranks: tuple[int, ...] = MIXED_RANKS
    bandwidth_tbs: float | None = None  # what the roofline divides by (None: no roofline)
    check: bool = True  # compare Triton with the torch loop once per case

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoraConfig:
        names = {f for f in cls.__dataclass_fields__ if f not in ("mixed_ranks", "bandwidth_tbs", "check")}
        return cls(**{n: getattr(args, n) for n in names}, bandwidth_tbs=args.bandwidth)


@dataclass
class Result:
    phase: str
    rank: int | str
    batch_size: int
    popularity: str
    tokens: int = 0
    tokens_per_request: int = 0
    adapters: int = 0  # distinct adapters in the batch
    max_rank: int = 0
    path: str = ""  # the Triton path taken: token | segment
    triton_us: float | None = None
    triton_graph_us: float | None = None
    loop_us: float | None = None
    loop_graph_us: float | None = None
    bmm_us: float | None = None
    roofline_us: float | None = None
    x_roofline: float | None = None  # triton_graph_us / roofline_us
    bmm_x: float | None = None  # bmm_us / triton_us (eager vs eager): > 1 when Triton is faster
    loop_x: float | None = None  # loop_us / triton_us
    loop_graph_x: float | None = None  # loop_graph_us / triton_graph_us
    max_abs_err: float | None = None  # Triton vs the torch loop, once per case
    rel_err: float | None = None
    ok: bool | None = None  # rel_err < 1e-2 (None: not checked)
    note: str = ""
    error: str | None = None  # the case failed (or was skipped): why

    @property
    def label(self) -> str:
        return Case(self.phase, self.rank, self.batch_size, self.popularity).label


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The kernels suite's flags (`KernelsSettings`)."""
    add_settings(p, KernelsSettings)


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
    add_arguments(p)
    args = p.parse_args(argv)
    if (problem := invalid(args)) is not None:
        p.error(problem)
    return args


def cases(config: LoraConfig) -> list[Case]:
    return [
        Case(phase, rank, bs, pop)
        for phase in config.phases
        for rank in config.ranks
        for bs in config.batch_sizes
        for pop in config.popularity
    ]


# --- the LoRA cases -----------------------------------------------------------------------------


def case_ranks(rank: int | str, num_adapters: int, mixed_ranks: tuple[int, ...]) -> list[int]:
    """Rank of each of the pool's adapters: all `rank`, or mixed_ranks cycled (adapter i: i mod len)."""
    if rank == "mixed":
        return [mixed_ranks[i % len(mixed_ranks)] for i in range(num_adapters)]
    assert isinstance(rank, int)
    return [rank] * num_adapters


def tokens_per_request(case: Case, config: LoraConfig) -> int:
    """1 when decoding; prefill_len, cut to max_prefill_tokens // batch_size (at least 1), when prefilling."""
    if case.phase == "decode":
        return 1
    return min(config.prefill_len, max(1, config.max_prefill_tokens // case.batch_size))


def roofline_us(
    num_tokens: int, ranks: list[int], d_in: int, d_out: int, itemsize: int, bandwidth_tbs: float | None
) -> float | None:
    """(T*d_in + 2*T*d_out + sum_a r_a*(d_in + d_out)) * itemsize / bandwidth, in microseconds.

    x is read once, y read and written once, each distinct adapter's A and B read once.
    """
    if not bandwidth_tbs:
        return None
    moved = (num_tokens * (d_in + 2 * d_out) + sum(ranks) * (d_in + d_out)) * itemsize
    return moved / (bandwidth_tbs * 1e12) * 1e6


Pools = dict[int | str, tuple[LoraGeometry, torch.Tensor, list[SyntheticAdapter]]]


def lora_pool(rank: int | str, config: LoraConfig, device: torch.device, pools: Pools):
    """(geometry, pool, adapters) for a rank spec, built once and shared by every case of that rank:
    max(batch_sizes) adapters, enough for any popularity pattern."""
    if rank not in pools:
        pools.clear()  # one rank spec at a time: the rank-128 pool of 256 adapters is 512 MiB
        if device.type == "cuda":
            torch.cuda.empty_cache()
        geometry = LoraGeometry.uniform(config.hidden, config.hidden, config.row_width, config.rows_per_page)
        ranks = case_ranks(rank, max(config.batch_sizes), config.mixed_ranks)
        pool, adapters = make_bench_lora_pool(geometry, ranks, (0,), getattr(torch, config.dtype), device)
        pools[rank] = (geometry, pool, adapters)
    return pools[rank]


def _errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float | None, float | None, bool]:
    """(max |out - ref|, ||out - ref||_F / ||ref||_F, rel < 1e-2); None for a non-finite error."""
    diff = (out.float() - ref.float()).abs()
    max_abs = diff.max().item() if diff.numel() else 0.0
    rel = (diff.norm() / ref.float().norm().clamp_min(1e-30)).item() if diff.numel() else 0.0
    if not (math.isfinite(max_abs) and math.isfinite(rel)):
        return None, None, False
    return max_abs, rel, rel < 1e-2


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_case(case: Case, config: LoraConfig, device: torch.device, timers: Timers, pools: Pools) -> Result:
    """Build the case's batch on `device` (pool shared per rank) and time the three implementations."""
    from loraserve.kernels.lora_triton import TOKEN_PATH_MAX_SEG_LEN, lora_apply_triton, prepare_lora_triton

    dtype = getattr(torch, config.dtype)
    geometry, pool, adapters = lora_pool(case.rank, config, device, pools)
    assigned = assign_adapters(case.popularity, case.batch_size, seed=case.batch_size)
    per_request = tokens_per_request(case, config)
    requests = [(a, per_request) for a in sorted(assigned)]  # grouped by adapter, as the scheduler batches them
    batch = make_lora_plan(geometry, adapters, requests, device=device)
    assert batch is not None
    plans = {
        lora_apply_triton: replace(batch, prepared=prepare_lora_triton(batch, dtype)),
        lora_apply_torch: replace(batch, prepared=prepare_lora_torch(batch, dtype)),
        lora_apply_bmm: replace(batch, prepared=prepare_lora_bmm(batch, dtype)),
    }
    num_tokens = per_request * case.batch_size
    g = torch.Generator(device=device).manual_seed(case.batch_size)
    x = torch.randn(num_tokens, config.hidden, generator=g, device=device, dtype=dtype)
    y = torch.zeros(num_tokens, config.hidden, device=device, dtype=dtype)
    layer = pool[0]
    result = Result(case.phase, case.rank, case.batch_size, case.popularity, num_tokens, per_request)
    result.adapters, result.max_rank = len(batch.ranks), max(batch.ranks)
    result.path = "token" if batch.max_seg_len <= TOKEN_PATH_MAX_SEG_LEN else "segment"
    if case.phase == "prefill" and per_request < config.prefill_len:
        result.note = f"prefill cut to {per_request} tokens/request ({config.max_prefill_tokens} tokens at most)"

    def call(fn: Callable) -> Fn:
        if fn is lora_apply_triton:
            return lambda: fn(y, x, layer, plans[fn], 0, 0)
        return lambda: fn((y,), x, layer, plans[fn], 0, 0)

    if config.check:  # also the warm-up: compiles the kernels
        outs = []
        for fn in (lora_apply_triton, lora_apply_torch):
            y.zero_()
            call(fn)()
            outs.append(y.clone())
        result.max_abs_err, result.rel_err, result.ok = _errors(*outs)
    result.triton_us = timed(result, "triton", timers.eager, call(lora_apply_triton))
    result.triton_graph_us = timed(result, "triton graph", timers.graph, call(lora_apply_triton))
    result.loop_us = timed(result, "loop", timers.eager, call(lora_apply_torch))
    result.loop_graph_us = timed(result, "loop graph", timers.graph, call(lora_apply_torch))
    result.bmm_us = timed(result, "bmm", timers.eager, call(lora_apply_bmm))
    itemsize = torch.finfo(dtype).bits // 8
    result.roofline_us = roofline_us(
        num_tokens, batch.ranks, config.hidden, config.hidden, itemsize, config.bandwidth_tbs
    )
    return with_ratios(result)


def with_ratios(r: Result) -> Result:
    r.x_roofline = ratio(r.triton_graph_us, r.roofline_us)
    r.bmm_x, r.loop_x = ratio(r.bmm_us, r.triton_us), ratio(r.loop_us, r.triton_us)
    r.loop_graph_x = ratio(r.loop_graph_us, r.triton_graph_us)
    return r


def fmt(value: float | None, spec: str | None = None) -> str:
    """value in `spec`; by default 3 significant digits below 1000 (5.47, 0.00422), whole numbers above."""
    if value is None:
        return "-"
    return format(value, spec or (".3g" if abs(value) < 1000 else ".0f"))


TEXT_COLUMNS = (  # header, width: the plain-text table
    ("phase", 7),
    ("rank", 5),
    ("batch", 5),
    ("popularity", 10),
    ("tokens", 6),
    ("adapt", 5),
    ("path", 7),
    ("triton us", 9),
    ("graph us", 9),
    ("loop us", 9),
    ("loop gr", 9),
    ("bmm us", 9),
    ("roof us", 9),
    ("x bmm", 6),
    ("x loop", 6),
    ("% roof", 6),
    ("err", 7),
)


def format_table(results: list[Result]) -> str:
    """Plain-text table (progress lines on stderr, the CLI's output); % roof = roofline / Triton time
    (graph, else eager)."""

    def line(cells: list[str]) -> str:
        return " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, TEXT_COLUMNS, strict=True))

    head = line([h for h, _ in TEXT_COLUMNS])
    lines = [head, "-" * len(head)]
    for r in results:
        share = ratio(r.roofline_us, r.triton_graph_us or r.triton_us)
        cells = [r.phase, str(r.rank), str(r.batch_size), r.popularity, str(r.tokens), str(r.adapters), r.path]
        cells += [fmt(v) for v in (r.triton_us, r.triton_graph_us, r.loop_us, r.loop_graph_us, r.bmm_us)]
        cells += [fmt(v) for v in (r.roofline_us, r.bmm_x, r.loop_x)]
        cells += [fmt(None if share is None else 100 * share, ".0f"), fmt(r.max_abs_err, ".0e")]
        lines.append(line(cells) + (f"  {r.error}" if r.error else ""))
    return "\n".join(lines)


def benchmark(
    config: LoraConfig, device: torch.device, timers: Timers, deadline: float | None = None, progress: bool = True
) -> list[Result]:
    """Every case of the sweep; past `deadline` (time.monotonic()) the rest are rows with error "skipped"."""
    results, pools = [], {}
    if progress:
        print("\n".join(format_table([]).splitlines()[:1]), file=sys.stderr, flush=True)
    for case in cases(config):
        if deadline is not None and time.monotonic() > deadline:
            results.append(Result(case.phase, case.rank, case.batch_size, case.popularity, error="skipped"))
            continue
        try:
            results.append(run_case(case, config, device, timers, pools))
        except Exception as exc:  # one failing case (memory, capture) must not lose the others
            message = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            results.append(Result(case.phase, case.rank, case.batch_size, case.popularity, error=message))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if progress:
            print(format_table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    pools.clear()
    return results


# --- the suite ----------------------------------------------------------------------------------


def suite_config(dry_run: bool) -> LoraConfig:
    """The suite's sweep; tiny shapes for the dry run (CPU, interpreter)."""
    if dry_run:
        return LoraConfig(
            ranks=[4, "mixed"],
            batch_sizes=[1, 3],
            popularity=["distinct", "identical"],
            prefill_len=5,
            hidden=64,
            row_width=32,
            rows_per_page=8,
            mixed_ranks=(2, 4, 8),
        )
    return LoraConfig()


def ensure_interpreter() -> None:
    """The dry run needs TRITON_INTERPRET=1 before triton is imported: set it, or refuse if too late."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise RuntimeError(
            "run_suite(dry_run=True) runs Triton's interpreter on CPU: set TRITON_INTERPRET=1 before "
            "triton is imported (it already is, without it)"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def _versions() -> dict[str, str | None]:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}


def suite_meta(dry_run: bool, device: torch.device) -> dict[str, Any]:
    """Device, versions and bandwidths: measured (GPU), datasheet, and the one the roofline uses."""
    if dry_run:
        name, measured, datasheet = f"cpu ({platform.processor() or platform.machine()})", None, None
    else:
        name = torch.cuda.get_device_name(device)
        measured, datasheet = measure_bandwidth(device), default_bandwidth(name)
    return {
        "device": name,
        "dry_run": dry_run,
        **_versions(),
        "measured_bandwidth_tbs": measured,
        "datasheet_bandwidth_tbs": datasheet,
        "roofline_bandwidth_tbs": measured or PLACEHOLDER_BANDWIDTH_TBS,
        "roofline_bandwidth_is_placeholder": measured is None,
        "roofline_bandwidth_source": "placeholder" if measured is None else "measured",
        "timing": (
            "wall clock, one call, Triton interpreter (not a performance figure)"
            if dry_run
            else "eager: triton do_bench median (L2 flushed); graph: CUDA-graph replay median (L2 flushed)"
        ),
    }


def _headline(results: list[Result], want: Case) -> Result | None:
    """The wanted case's row, else the closest stand-in (dry run): decode, distinct, smallest int rank,
    largest batch."""
    measured = [r for r in results if r.error is None]
    exact = [
        r
        for r in measured
        if (r.phase, r.rank, r.batch_size, r.popularity) == (want.phase, want.rank, want.batch_size, want.popularity)
    ]
    if exact:
        return exact[0]
    similar = [r for r in measured if r.phase == want.phase and r.popularity == want.popularity]
    similar = [r for r in similar if isinstance(r.rank, int)]
    return min(similar, key=lambda r: (r.rank, -r.batch_size), default=None)


def lora_summary(results: list[Result]) -> dict[str, Any]:
    """The targets: decode b64 distinct r16 within 2x of the roofline (graph time, eager when there is
    no graph), and Triton (eager) faster than bmm (eager) in every case."""
    head = _headline(results, Case("decode", 16, 64, "distinct"))
    headline = None
    if head is not None:
        timing = "graph" if head.triton_graph_us is not None else "eager"
        t = head.triton_graph_us if timing == "graph" else head.triton_us
        headline = {
            "case": head.label,
            "timing": timing,
            "triton_us": head.triton_us,
            "triton_graph_us": head.triton_graph_us,
            "roofline_us": head.roofline_us,
            "x_roofline": ratio(t, head.roofline_us),
        }
    measured = [r for r in results if r.error is None]
    with_bmm = [r for r in measured if r.triton_us is not None and r.bmm_us is not None]
    with_loop = [r for r in measured if r.triton_us is not None and r.loop_us is not None]
    not_faster_bmm = [r.label for r in with_bmm if r.triton_us >= r.bmm_us]
    not_faster_loop = [r.label for r in with_loop if r.triton_us >= r.loop_us]
    x = headline["x_roofline"] if headline else None
    return {
        "lora_decode_b64_distinct_r16": headline,
        "within_2x_roofline": x is not None and x <= ROOFLINE_FACTOR,
        "faster_than_bmm_everywhere": bool(with_bmm) and not not_faster_bmm,
        "not_faster_than_bmm": not_faster_bmm,
        "faster_than_loop_everywhere": bool(with_loop) and not not_faster_loop,
        "not_faster_than_loop": not_faster_loop,
        "lora_all_correct": bool(measured) and all(r.ok is not False for r in measured),
        "lora_errors": [f"{r.label}: {r.error}" for r in results if r.error not in (None, "skipped")],
        "lora_skipped": [r.label for r in results if r.error == "skipped"],
    }


def lora_markdown(results: list[Result]) -> str:
    headers = [
        "phase",
        "rank",
        "batch",
        "popularity",
        "tokens",
        "adapters",
        "path",
        "triton µs",
        "graph µs",
        "loop µs",
        "loop graph µs",
        "bmm µs",
        "roofline µs",
        "graph/roof",
        "bmm/triton",
        "loop/triton",
        "max err",
    ]
    rows = []
    for r in results:
        if r.error is not None:
            rows.append([r.phase, str(r.rank), str(r.batch_size), r.popularity, *["-"] * 12, r.error])
            continue
        tokens = f"{r.tokens}" + (f" ({r.tokens_per_request}/req)" if r.phase == "prefill" else "")
        rank = f"mixed ≤ {r.max_rank}" if r.rank == "mixed" else str(r.rank)
        rows.append(
            [
                r.phase,
                rank,
                str(r.batch_size),
                r.popularity,
                tokens,
                str(r.adapters),
                r.path,
                fmt(r.triton_us),
                fmt(r.triton_graph_us),
                fmt(r.loop_us),
                fmt(r.loop_graph_us),
                fmt(r.bmm_us),
                fmt(r.roofline_us),
                fmt(r.x_roofline),
                fmt(r.bmm_x),
                fmt(r.loop_x),
                fmt(r.max_abs_err, ".1e"),
            ]
        )
    return markdown_table(headers, rows)


def target_lines(summary: dict[str, Any]) -> list[str]:
    """One markdown line per target."""
    head = summary["lora_decode_b64_distinct_r16"]
    if head is None:
        within = "- LoRA decode b64 distinct r16 within 2× roofline: not measured"
    else:
        t = head["triton_graph_us"] if head["timing"] == "graph" else head["triton_us"]
        within = (
            f"- LoRA {head['case']} within 2× roofline: **{'yes' if summary['within_2x_roofline'] else 'no'}** "
            f"({fmt(t)} µs {head['timing']} vs {fmt(head['roofline_us'])} µs roofline, "
            f"{fmt(head['x_roofline'])}×)"
        )
    slower = summary["not_faster_than_bmm"]
    bmm = (
        f"- Triton faster than gather-then-bmm in every case (eager vs eager): "
        f"**{'yes' if summary['faster_than_bmm_everywhere'] else 'no'}**"
        + (f" (not in {len(slower)}: {', '.join(slower)})" if slower else "")
    )
    correct = "- Triton agrees with the torch references in every case: " + (
        "**yes**" if summary["lora_all_correct"] and summary["attention_all_correct"] else "**no**"
    )
    return [within, bmm, correct, attention_line(summary["attention_decode_b64_ctx4096"])]


def attention_line(head: dict[str, Any] | None) -> str:
    """The attention headline: Triton (graph, else eager) against the roofline and SDPA."""
    if head is None:
        return "- Paged attention decode 64 × 1 at context 4096: not measured"
    graph = head["triton_graph_us"] is not None
    t, sdpa = (head["triton_graph_us"], head["sdpa_graph_us"]) if graph else (head["triton_us"], head["sdpa_us"])
    return (
        f"- Paged attention {head['case']}: {fmt(t)} µs {'graph' if graph else 'eager'} vs "
        f"{fmt(head['roofline_us'])} µs roofline ({fmt(ratio(t, head['roofline_us']))}×), dense SDPA {fmt(sdpa)} µs"
    )


def suite_markdown(meta: dict[str, Any], lora: list[Result], attention: list, summary: dict[str, Any]) -> str:
    from loraserve.bench.suites.kernels.attention import attention_markdown

    bw = meta["measured_bandwidth_tbs"]
    bandwidth = (
        f"measured {bw:.2f} TB/s (datasheet {meta['datasheet_bandwidth_tbs']})"
        if bw
        else f"placeholder {meta['roofline_bandwidth_tbs']} TB/s (dry run: nothing measured)"
    )
    return "\n\n".join(
        [
            f"**{meta['device']}**, {meta['dtype']}, h = {meta['hidden']}, bandwidth {bandwidth}; "
            f"torch {meta['torch']}, triton {meta['triton']}. Times: {meta['timing']}.",
            "\n".join(target_lines(summary)),
            "### Batched LoRA (one projection h → h)\n\n" + lora_markdown(lora),
            "### Paged attention\n\n" + attention_markdown(attention),
        ]
    )


def run_suite(dry_run: bool = False, budget_s: float = SUITE_BUDGET_S, progress: bool = True) -> dict[str, Any]:
    """The GPU suite's kernel part: LoRA sweep and attention cases, JSON-serialisable.

    Returns {"meta", "lora": [rows], "attention": [rows], "summary", "markdown"}. Attention runs first
    (it is short), then LoRA; a case not started within budget_s of the start is skipped and listed.
    dry_run: tiny shapes on CPU under Triton's interpreter, wall-clock times, no graphs, and a
    placeholder bandwidth of 1 TB/s for the roofline (flagged in meta). progress: a line per case
    on stderr.
    """
    start = time.monotonic()
    if dry_run:
        ensure_interpreter()
    elif not torch.cuda.is_available():
        raise RuntimeError("run_suite needs a CUDA device (or dry_run=True)")
    from loraserve.bench.suites.kernels import attention as attention_bench

    device = torch.device("cpu" if dry_run else "cuda")
    timers = wall_timers() if dry_run else cuda_timers(device)
    config = suite_config(dry_run)
    meta = {**suite_meta(dry_run, device), "dtype": config.dtype, "hidden": config.hidden, "budget_s": budget_s}
    config = replace(config, bandwidth_tbs=meta["roofline_bandwidth_tbs"])
    att_config = replace(attention_bench.suite_config(dry_run), bandwidth_tbs=meta["roofline_bandwidth_tbs"])
    attention = attention_bench.benchmark(att_config, device, timers, start + 0.3 * budget_s, progress)
    lora = benchmark(config, device, timers, start + budget_s, progress)
    summary = {**lora_summary(lora), **attention_bench.attention_summary(attention)}
    summary["elapsed_s"] = meta["elapsed_s"] = round(time.monotonic() - start, 1)
    return {
        "meta": meta,
        "lora": [asdict(r) for r in lora],
        "attention": [asdict(r) for r in attention],
        "summary": summary,
        "markdown": suite_markdown(meta, lora, attention, summary),
    }


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


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """The CLI's LoRA sweep on the GPU: {"meta", "results": [rows], "summary", "markdown"}."""
    device = torch.device("cuda")
    meta = suite_meta(False, device)
    meta.update(dtype=args.dtype, hidden=args.hidden)
    if args.bandwidth is not None:
        meta.update(roofline_bandwidth_tbs=args.bandwidth, roofline_bandwidth_source="--bandwidth")
    config = replace(LoraConfig.from_args(args), bandwidth_tbs=meta["roofline_bandwidth_tbs"])
    results = benchmark(config, device, cuda_timers(device, rep_ms=args.rep, warmup_ms=args.rep / 2))
    print(f"\n{meta['device']}, {args.dtype}, h={args.hidden}\n\n{format_table(results)}\n", file=sys.stderr)
    return {
        "meta": meta,
        "results": [asdict(r) for r in results],
        "summary": lora_summary(results),
        "markdown": lora_markdown(results),
    }
