"""GPU benchmark of the paged-attention kernel against dense SDPA and the bandwidth roofline.

    loraserve bench --suite attention [--dry-run] [--out DIR]

Cases (GQA, 32 query heads over 8 KV heads, head_dim 128, fp16, 16 tokens per page): decode steps of
1, 16, 64, 256 sequences at context 512 and 4096 (one new token each, attending to the whole
context), and prefill of 4 x 512 and 1 x 2048 new tokens (causal, no earlier context). Every
sequence of a case has the same length, its K/V in random pages of one pool
(`bench/common/kernel_cases.py`, `make_uniform_attention_case`). Measured:

    triton    attention_triton on the paged pool (its index tensors built once before timing, as
              the engine builds them once per step for every layer); decode splits long contexts
              when few sequences leave SMs idle (flash-decoding)
    unsplit   decode only: the same kernel with the split turned off (splits=1), in a CUDA graph:
              what the split gains
    sdpa      torch.nn.functional.scaled_dot_product_attention on contiguous K/V [B, H_kv, S, D]
              with enable_gqa: the same attention without paging (is_causal for prefill)
    roofline  bytes that must move / measured bandwidth:
              (B*S*H_kv*D*2 + 2*T*H*D) * itemsize / bw      (K and V read once, q read, out written)
    compute   FLOPs / datasheet fp16 tensor peak (None when unknown):
              4 * H * D * sum over queries of the keys each attends to (QK^T and PV, 2 flops a MAC)

Times as in `loraserve.bench.suites.kernels.suite` (eager do_bench and CUDA-graph replay, medians, L2 flushed).
x_roofline = triton_graph_us / max(roofline_us, compute_us): prefill at these sizes is compute-bound.
Every case is checked once: Triton's output against SDPA's (max_abs_err; ok when allclose at
4e-3 abs/rel or relative Frobenius error < 1e-2), so a wrong kernel cannot post a fast time unnoticed.

DIR/results.json: `results.py`, a record per case (`AttentionResult`).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from loraserve.bench.common.kernel_cases import make_uniform_attention_case
from loraserve.bench.common.stats import ratio
from loraserve.bench.common.tables import fmt, markdown_table
from loraserve.bench.suites.kernels.device import ensure_interpreter, suite_meta
from loraserve.bench.suites.kernels.results import write_report
from loraserve.bench.suites.kernels.timing import Timers, cuda_timers, errors, timed, wall_timers
from loraserve.config_cli import setting

# dense fp16/bf16 tensor-core peak by device-name substring, first match wins (datasheets, no sparsity)
PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0}
ATOL = 4e-3  # and as rtol: Triton against SDPA


@dataclass(frozen=True)
class AttentionCase:
    phase: str  # decode | prefill
    seqs: int
    context: int  # keys per sequence (the new tokens included)
    query_len: int  # new tokens per sequence

    @property
    def label(self) -> str:
        return f"{self.phase} {self.seqs}x{self.query_len} ctx {self.context}"


@dataclass
class AttentionConfig:
    decode_seqs: list[int] = field(default_factory=lambda: [1, 16, 64, 256])
    decode_contexts: list[int] = field(default_factory=lambda: [512, 4096])
    prefill: list[tuple[int, int]] = field(default_factory=lambda: [(4, 512), (1, 2048)])  # (seqs, tokens)
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    tokens_per_page: int = 16
    dtype: str = "float16"
    bandwidth_tbs: float | None = None
    peak_tflops: float | None = None
    check: bool = True


@dataclass
class AttentionResult:
    phase: str
    seqs: int
    context: int
    query_len: int
    tokens: int = 0
    triton_us: float | None = None
    triton_graph_us: float | None = None
    unsplit_graph_us: float | None = None  # decode with splits=1
    sdpa_us: float | None = None
    sdpa_graph_us: float | None = None
    roofline_us: float | None = None
    compute_us: float | None = None
    x_roofline: float | None = None  # triton_graph_us / max(roofline_us, compute_us)
    sdpa_x: float | None = None  # sdpa / triton, graph times (eager when there are none): > 1 when Triton wins
    max_abs_err: float | None = None  # Triton vs SDPA
    rel_err: float | None = None
    ok: bool | None = None
    note: str = ""
    error: str | None = None

    @property
    def label(self) -> str:
        return AttentionCase(self.phase, self.seqs, self.context, self.query_len).label


def suite_config(dry_run: bool) -> AttentionConfig:
    """The suite's cases; tiny ones for the dry run (CPU, interpreter)."""
    if dry_run:
        return AttentionConfig(
            decode_seqs=[1, 3],
            decode_contexts=[7, 20],
            prefill=[(2, 6)],
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            tokens_per_page=4,
        )
    return AttentionConfig()


def cases(config: AttentionConfig) -> list[AttentionCase]:
    decode = [AttentionCase("decode", b, s, 1) for s in config.decode_contexts for b in config.decode_seqs]
    return decode + [AttentionCase("prefill", b, n, n) for b, n in config.prefill]


def peak_tflops(device_name: str) -> float | None:
    return next((tf for key, tf in PEAK_TFLOPS.items() if key in device_name), None)


def roofline_us(case: AttentionCase, config: AttentionConfig, itemsize: int) -> float | None:
    """(B*S*H_kv*D*2 + 2*T*H*D) * itemsize / bandwidth: K and V read once, q read, out written."""
    if not config.bandwidth_tbs:
        return None
    kv = case.seqs * case.context * config.num_kv_heads * config.head_dim * 2
    io = 2 * case.seqs * case.query_len * config.num_heads * config.head_dim
    return (kv + io) * itemsize / (config.bandwidth_tbs * 1e12) * 1e6


def flops(case: AttentionCase, config: AttentionConfig) -> int:
    """4 * H * D * sum over queries of the keys they attend to; query i of n attends S - n + i + 1 keys."""
    n, s = case.query_len, case.context
    keys = n * (s - n) + n * (n + 1) // 2
    return 4 * config.num_heads * config.head_dim * keys * case.seqs


def compute_us(case: AttentionCase, config: AttentionConfig) -> float | None:
    return flops(case, config) / (config.peak_tflops * 1e12) * 1e6 if config.peak_tflops else None


def run_case(case: AttentionCase, config: AttentionConfig, device: torch.device, timers: Timers) -> AttentionResult:
    """Build the case on `device`, check Triton against SDPA once, time both."""
    from loraserve.kernels.attention_triton import attention_triton

    dtype = getattr(torch, config.dtype)
    h, h_kv, d = config.num_heads, config.num_kv_heads, config.head_dim
    data = make_uniform_attention_case(
        case.seqs, case.context, case.query_len, h, h_kv, d, config.tokens_per_page, dtype, device=device
    )
    scale = d**-0.5
    q_dense = data.q.view(case.seqs, case.query_len, h, d).transpose(1, 2)  # [B, H, L, D]
    k_dense, v_dense = data.keys.transpose(1, 2), data.values.transpose(1, 2)  # [B, H_kv, S, D]
    causal = case.query_len > 1
    assert not causal or case.query_len == case.context  # SDPA's causal mask is top-left aligned

    def triton_call() -> torch.Tensor:
        return attention_triton(data.q, data.pool_layer, data.batch, h_kv, scale)

    def sdpa_call() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, is_causal=causal, scale=scale, enable_gqa=True)

    result = AttentionResult(case.phase, case.seqs, case.context, case.query_len, tokens=data.q.shape[0])
    out = triton_call()  # also builds the batch's index tensors (cached) and compiles: before any capture
    if config.check:
        ref = sdpa_call().transpose(1, 2).reshape(data.q.shape)
        result.max_abs_err, result.rel_err, result.ok = errors(out, ref, ATOL)
    result.triton_us = timed(result, "triton", timers.eager, triton_call)
    result.triton_graph_us = timed(result, "triton graph", timers.graph, triton_call)
    if case.phase == "decode":
        unsplit = lambda: attention_triton(data.q, data.pool_layer, data.batch, h_kv, scale, splits=1)  # noqa: E731
        unsplit()  # compiles before any capture
        result.unsplit_graph_us = timed(result, "unsplit graph", timers.graph, unsplit)
    result.sdpa_us = timed(result, "sdpa", timers.eager, sdpa_call)
    result.sdpa_graph_us = timed(result, "sdpa graph", timers.graph, sdpa_call)
    result.roofline_us = roofline_us(case, config, torch.finfo(dtype).bits // 8)
    result.compute_us = compute_us(case, config)
    floor = max(result.roofline_us or 0.0, result.compute_us or 0.0) or None
    result.x_roofline = ratio(result.triton_graph_us, floor)
    graphs = result.triton_graph_us is not None and result.sdpa_graph_us is not None
    result.sdpa_x = (
        ratio(result.sdpa_graph_us, result.triton_graph_us) if graphs else ratio(result.sdpa_us, result.triton_us)
    )
    return result


def benchmark(
    config: AttentionConfig, device: torch.device, timers: Timers, deadline: float | None = None, progress: bool = True
) -> list[AttentionResult]:
    """Every case; past `deadline` (time.monotonic()) the rest are rows with error "skipped"."""
    if config.peak_tflops is None and device.type == "cuda":
        config = replace(config, peak_tflops=peak_tflops(torch.cuda.get_device_name(device)))
    results = []
    for case in cases(config):
        fields = (case.phase, case.seqs, case.context, case.query_len)
        if deadline is not None and time.monotonic() > deadline:
            results.append(AttentionResult(*fields, error="skipped"))
            continue
        try:
            results.append(run_case(case, config, device, timers))
        except Exception as exc:  # one failing case (memory, capture) must not lose the others
            results.append(AttentionResult(*fields, error=f"{type(exc).__name__}: {exc}".splitlines()[0][:200]))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the 256 x 4096 case holds 8 GiB of K/V
        if progress:
            print(_progress_line(results[-1]), file=sys.stderr, flush=True)
    return results


def _progress_line(r: AttentionResult) -> str:
    return (
        f"attention {r.label:<24} triton {fmt(r.triton_us)} us, graph {fmt(r.triton_graph_us)} us, "
        f"sdpa {fmt(r.sdpa_us)} us, roofline {fmt(r.roofline_us)} us, err {fmt(r.max_abs_err, '.1e')}"
        + (f"  {r.error}" if r.error else "")
    )


def attention_markdown(results: list[AttentionResult]) -> str:
    headers = ["phase", "seqs × new", "context", "triton µs", "graph µs", "unsplit graph µs", "sdpa µs"]
    headers += ["sdpa graph µs", "roofline µs", "compute µs", "graph/floor", "sdpa/triton", "max err"]
    rows = []
    for r in results:
        shape = f"{r.seqs} × {r.query_len}"
        if r.error is not None:
            rows.append([r.phase, shape, str(r.context), *["-"] * 9, r.error])
            continue
        times = (r.triton_us, r.triton_graph_us, r.unsplit_graph_us, r.sdpa_us, r.sdpa_graph_us, r.roofline_us)
        cells = [fmt(v) for v in (*times, r.compute_us, r.x_roofline, r.sdpa_x)]
        rows.append([r.phase, shape, str(r.context), *cells, fmt(r.max_abs_err, ".1e")])
    return markdown_table(headers, rows)


def attention_summary(results: list[AttentionResult]) -> dict[str, Any]:
    """Headline decode case (64 sequences at context 4096, or the largest measured decode case), the
    cases where SDPA is faster, and whether every case was correct."""
    measured = [r for r in results if r.error is None]
    decode = [r for r in measured if r.phase == "decode"]
    exact = [r for r in decode if (r.seqs, r.context) == (64, 4096)]
    head = exact[0] if exact else max(decode, key=lambda r: (r.context, r.seqs), default=None)
    headline = None
    if head is not None:
        times = ("triton_us", "triton_graph_us", "unsplit_graph_us", "sdpa_us", "sdpa_graph_us", "roofline_us")
        headline = {"case": head.label} | {k: getattr(head, k) for k in (*times, "x_roofline")}
    return {
        "attention_decode_b64_ctx4096": headline,
        "attention_slower_than_sdpa": [r.label for r in measured if r.sdpa_x is not None and r.sdpa_x < 1.0],
        "attention_all_correct": bool(measured) and all(r.ok is not False for r in measured),
        "attention_errors": [f"{r.label}: {r.error}" for r in results if r.error not in (None, "skipped")],
        "attention_skipped": [r.label for r in results if r.error == "skipped"],
    }


def run(dry_run: bool = False) -> dict[str, Any]:
    """The attention cases alone: {"meta", "attention": [rows], "summary", "markdown"}."""
    if dry_run:
        ensure_interpreter()
    device = torch.device("cpu" if dry_run else "cuda")
    meta = suite_meta(dry_run, device)
    config = replace(suite_config(dry_run), bandwidth_tbs=meta["roofline_bandwidth_tbs"])
    timers = wall_timers() if dry_run else cuda_timers(device)
    results = benchmark(config, device, timers)
    return {
        "meta": meta,
        "attention": [asdict(r) for r in results],
        "summary": attention_summary(results),
        "markdown": attention_markdown(results),
    }


@dataclass(frozen=True)
class AttentionSettings:
    """The attention suite's flags (its own alone)."""

    dry_run: bool = setting(False, "tiny shapes on CPU under Triton's interpreter")
    out: Path | None = setting(None, "write DIR/results.json")


SETTINGS = AttentionSettings


def main(args: argparse.Namespace) -> int:
    if not args.dry_run and not torch.cuda.is_available():
        print("the attention benchmark needs a CUDA device (none is available)", file=sys.stderr)
        return 2
    report = run(dry_run=args.dry_run)
    print(report["markdown"])
    if args.out is not None:
        print(f"results: {write_report(args.out, 'attention', report, 'attention')}", file=sys.stderr)
    return 0
