"""The LoRA kernels' benchmark cases (`cases`), one case measured (`run_case`) and the sweep (`benchmark`);
`suite.py` has the suite's flags and what it measures.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from loraserve.bench.common.kernel_cases import (
    POPULARITIES,
    LoraGeometry,
    SyntheticAdapter,
    assign_adapters,
    make_bench_lora_pool,
    make_lora_plan,
)
from loraserve.bench.common.stats import ratio
from loraserve.bench.common.tables import fmt
from loraserve.bench.suites.kernels.timing import Fn, Timers, errors, timed
from loraserve.kernels.lora_bmm import lora_apply_bmm, prepare_lora_bmm
from loraserve.kernels.lora_torch import lora_apply_torch, prepare_lora_torch

MIXED_RANKS = (8, 16, 32, 64, 128)
PHASES = ("decode", "prefill")
# the GPU suite's sweep
SUITE_RANKS: tuple[int | str, ...] = (16, 64, 128, "mixed")
SUITE_BATCH_SIZES = (1, 8, 64, 256)
SUITE_BUDGET_S = 55.0  # seconds; the part runs under a 70 s limit (gpu_check.GPU_LIMITS_S)


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


def cases(config: LoraConfig) -> list[Case]:
    """Every (phase, rank, batch size, popularity), the last varying fastest."""
    return [Case(*c) for c in itertools.product(config.phases, config.ranks, config.batch_sizes, config.popularity)]


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
        result.max_abs_err, result.rel_err, result.ok = errors(*outs)
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


# header, width: the plain-text table's columns (the case, the times, the ratios and the error)
TEXT_COLUMNS = (("phase", 7), ("rank", 5), ("batch", 5), ("popularity", 10), ("tokens", 6), ("adapt", 5), ("path", 7))
TEXT_COLUMNS += (("triton us", 9), ("graph us", 9), ("loop us", 9), ("loop gr", 9), ("bmm us", 9), ("roof us", 9))
TEXT_COLUMNS += (("x bmm", 6), ("x loop", 6), ("% roof", 6), ("err", 7))


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
